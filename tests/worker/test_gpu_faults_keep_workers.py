"""A GPU fault never costs a worker, with distributed's own GPU diagnostics at their
default (``distributed.diagnostics.nvml`` on).

A device that fails NVML is withdrawn and its worker kept, serving CPU work, until the
device answers again (no restart into a fault accelsched can see); a worker process that
starts while its GPU fails NVML (a leak's restart) starts anyway, leaves it out and takes
it back once it answers. Nothing here turns distributed's diagnostics off.
"""

from __future__ import annotations

import asyncio
import os

import dask
import pytest
from distributed import Event, Nanny
from distributed.utils_test import gen_cluster

import accelsched
from accelsched.testing import fake_gpus
from tests.utils import (
    TWO_GPU_WORKERS,
    cvd,
    events,
    gpus,
    hold,
    inc,
    marked_warm_up,
    run_python,
    wait_for,
)

# ---- distributed's SystemMonitor in a process whose GPU fails NVML -----------------------

MONITOR = """
import sys
from distributed.diagnostics import nvml
if sys.argv[1] == "wrapped":
    from accelsched.internals.forkserver import start_despite_failing_gpu
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


# ---- a transient fault right after verification, on nanny workers ------------------------


@pytest.mark.parametrize("peer", [True, False])
def test_a_transient_fault_after_verification_costs_no_worker(peer: bool) -> None:
    """GPU 0 fails every NVML query for 3 s right after both workers were verified: it is
    withdrawn, its worker kept (same process, serving CPU work, no restart asked), and
    within a minute every worker and every GPU is back and GPU tasks run on each."""

    @gen_cluster(
        client=True,
        Worker=Nanny,
        nthreads=TWO_GPU_WORKERS if peer else [("127.0.0.1", 1, cvd("0"))],
        timeout=90,
    )
    async def run(c, s, *nannies):  # type: ignore[no-untyped-def]
        await accelsched.register(c, check_interval="100ms")
        workers = [n.worker_address for n in nannies]
        await wait_for(lambda: all(gpus(s, w) == 1 for w in workers))
        A = workers[0]
        pids = await c.run(os.getpid)
        g.fail(0)
        await wait_for(lambda: gpus(s, A) == 0)
        assert await c.submit(inc, 1, workers=[A], key="cpu") == 2  # CPU work goes on
        await asyncio.sleep(3)
        g.recover()
        await wait_for(lambda: all(gpus(s, w) == 1 for w in workers), timeout=60)
        assert set(s.workers) == set(workers) and await c.run(os.getpid) == pids
        assert not events(s, "restart") and not events(s, "restart-deferred")
        (unhealthy,) = events(s, "gpu-unhealthy")
        (recovered,) = events(s, "gpu-recovered")
        assert unhealthy["worker"] == recovered["worker"] == A
        with dask.annotate(resources={"GPU": 1}):  # one at a time per GPU: one on each
            held = c.map(hold, ["go"] * len(workers), key=[f"h-{w}" for w in workers])
        await wait_for(lambda: all(len(s.workers[w].executing) == 1 for w in workers))
        await Event("go").set()
        assert await c.gather(held) == [0] * len(workers)
        assert {next(iter(s.tasks[f.key].who_has)).address for f in held} == set(workers)

    with fake_gpus(2) as g:
        run()


# ---- a fault as a measured GPU task closes ---------------------------------------------------


@accelsched.gpu
def holds_a_gigabyte(seconds: float) -> object:
    """A GiB held on the device by its result, after ``seconds`` of work."""
    import time

    from accelsched.testing import device_alloc

    buffer = device_alloc(2**30)
    time.sleep(seconds)
    return buffer


def _live(dask_worker) -> int:  # type: ignore[no-untyped-def]
    return dask_worker.plugins["accelsched-guard"].ledger.live(0)


def test_a_fault_at_a_measured_runs_end_leaves_its_result_held() -> None:
    """NVML fails on the device from the middle of a measured GPU task until after it
    returned: its closing reading gives no figure, so the run is not measured; its result
    (a type accelsched knows) is held at its size, and once the device answers again no
    leak is found and the worker keeps its process (before: the run was taken as having
    grown by nothing, its result held at nothing, and the GiB it holds was declared a
    leak naming no step: the healthy worker was restarted)."""

    @gen_cluster(client=True, Worker=Nanny, nthreads=[("127.0.0.1", 1, cvd("0"))], timeout=90)
    async def run(c, s, a):  # type: ignore[no-untyped-def]
        await accelsched.register(c, check_interval="100ms", leak_threshold="256MiB")
        A = a.worker_address
        await wait_for(lambda: gpus(s, A) == 1)
        assert await c.submit(marked_warm_up, pure=False) == 0  # the context: runs measured
        pid = (await c.run(os.getpid))[A]
        held = c.submit(holds_a_gigabyte, 1.0, pure=False)
        await asyncio.sleep(0.5)
        g.fail(0)
        await held
        await asyncio.sleep(0.5)
        g.recover()
        await wait_for(lambda: events(s, "gpu-recovered") or events(s, "leak"), timeout=30)
        await asyncio.sleep(1)  # checks after it answers again
        assert not events(s, "leak") and not events(s, "restart")
        assert gpus(s, A) == 1
        assert (await c.run(_live))[A] == 2**30 and (await c.run(os.getpid))[A] == pid
        del held

    with fake_gpus(1) as g:
        run()
