"""A GPU fault never costs a worker, with distributed's own GPU diagnostics at their
default (``distributed.diagnostics.nvml`` on).

A device that fails NVML is withdrawn and its worker kept, serving CPU work, until the
device answers again (no restart into a fault accelsched can see); a worker process that
starts while its GPU fails NVML (a leak's restart) starts anyway, leaves it out and takes
it back once it answers. Nothing here turns distributed's diagnostics off.
"""

from __future__ import annotations

import dask
import pytest
from distributed import Nanny
from distributed.utils_test import gen_cluster

import accelsched
from accelsched.testing import fake_gpus
from tests.utils import TWO_GPU_WORKERS, cvd, events, gpus, inc, run_python, wait_for

pytestmark = pytest.mark.filterwarnings("ignore")

# ---- distributed's SystemMonitor in a process whose GPU fails NVML -----------------------

MONITOR = """
import sys
from distributed.diagnostics import nvml
if sys.argv[1] == "wrapped":
    from accelsched.internals.nvml_start import start_despite_failing_gpu
    assert start_despite_failing_gpu() and start_despite_failing_gpu()  # idempotent
from distributed import worker
from distributed.system_monitor import SystemMonitor
try:
    m = SystemMonitor()
except Exception as e:
    print("raised", type(e).__name__)
else:
    m.update()
    print("started", m.gpu_name is not None, "gpu" in worker.DEFAULT_METRICS)
"""


@pytest.mark.parametrize("fault", [None, "all", "lost"])
def test_a_process_starts_while_its_gpu_fails_nvml(fault: str | None) -> None:
    """Without the wrapper distributed's monitor raises out of a server's constructor (a
    nanny's new worker is lost); with it the process starts without GPU diagnostics, and
    where the device answers nothing changes."""
    with fake_gpus(1) as g:
        if fault:
            g.fail(0, fault)
        plain = run_python(MONITOR, "plain")
        wrapped = run_python(MONITOR, "wrapped")
    if fault is None:
        assert plain == wrapped == "started True True"
    else:
        error = "NVMLError_Unknown" if fault == "all" else "NVMLError_GpuIsLost"
        assert plain.splitlines()[-1] == f"raised {error}"
        assert wrapped.splitlines()[-1] == "started False False"
