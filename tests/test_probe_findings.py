"""Bugs an adversarial probe found (each confirmed against separate processes first),
pinned by a test each now that they are fixed: the guard's events without a
PlacementPlugin, steps the scheduler cannot load, callable instances, simulate's exec
errors, and a GPU lost at listing."""

from __future__ import annotations

import pickle
import subprocess
import sys
from typing import Any

import pytest
from dask._task_spec import Task
from distributed import Worker
from distributed.utils_test import gen_cluster

import accelsched
from accelsched.policy.marks import find_mark
from accelsched.protocol import GUARD_PLUGIN, PLACEMENT_PLUGIN
from tests.utils import ACCELSCHED, GPU_WORKER, gpus, wait_for

# --- a guard's event costs its worker the cluster ----------------------------------------


async def _worker_survives_a_guard_event(c: Any, s: Any, a: Worker) -> None:
    guard = a.plugins[GUARD_PLUGIN]
    guard._emit("leak", device=0, nbytes=1)  # what a real leak, fault or OOM sends
    a.log_event("probe-sentinel", "after")  # the stream is ordered: judged after it
    await wait_for(lambda: s.get_events("probe-sentinel"), timeout=5)
    assert a.address in s.workers
    assert await c.submit(lambda: 1, pure=False) == 1


@pytest.mark.usefixtures("fake_gpus_2")
@gen_cluster(client=True, nthreads=GPU_WORKER, Worker=Worker, timeout=60)
async def test_a_guard_event_without_placement_plugin_keeps_the_worker(c, s, a):
    await c.register_plugin(accelsched.GuardPlugin())
    await _worker_survives_a_guard_event(c, s, a)


@pytest.mark.usefixtures("fake_gpus_2")
@gen_cluster(client=True, nthreads=GPU_WORKER, Worker=Worker, timeout=60)
async def test_a_guard_event_after_unregistering_placement_keeps_the_worker(c, s, a):
    await accelsched.register(c)
    await wait_for(lambda: gpus(s, a.address) == 1)
    await c.unregister_scheduler_plugin(PLACEMENT_PLUGIN)
    await _worker_survives_a_guard_event(c, s, a)


# --- marked steps ------------------------------------------------------------------------


def test_a_step_the_scheduler_cannot_load_still_runs_where_it_loads(tmp_path, monkeypatch):
    """A notebook step using a library the scheduler lacks (cudf, torch): by value."""
    (tmp_path / "probe_only_on_workers.py").write_text("VALUE = 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    namespace: dict[str, Any] = {"__name__": "__main__"}
    exec(
        "import probe_only_on_workers\ndef step(x):\n    return probe_only_on_workers.VALUE + x\n",
        namespace,
    )
    client_bytes = pickle.dumps(accelsched.gpu(namespace["step"]))
    # the scheduler cannot import the module
    monkeypatch.delitem(sys.modules, "probe_only_on_workers")
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(tmp_path)])
    on_scheduler = pickle.loads(client_bytes)
    assert on_scheduler.__accelsched_gpu__.count == 1
    scheduler_bytes = pickle.dumps(on_scheduler)
    # the worker can
    monkeypatch.syspath_prepend(str(tmp_path))
    on_worker = pickle.loads(scheduler_bytes)
    assert on_worker(1) == 43


class CalledModel:
    @accelsched.gpu
    def __call__(self, x: Any) -> Any:
        return x


class InheritedModel(CalledModel):
    pass


def run_partition(func: Any, x: Any) -> Any:  # as apply_and_enforce(_func=...) does
    return func(x)


@pytest.mark.parametrize(
    "task",
    [
        pytest.param(lambda: Task("k", InheritedModel(), 1), id="inherited-call"),
        pytest.param(lambda: Task("k", run_partition, CalledModel(), 1), id="instance-as-arg"),
    ],
)
def test_a_callable_instance_with_a_marked_call_is_a_gpu_task(task):
    accelsched.gpu(lambda: None)  # a marked step exists in this process
    assert find_mark(task()) is not None


# --- accelsched simulate -----------------------------------------------------------------


def test_simulate_a_command_that_cannot_execute_is_one_line(tmp_path):
    script = tmp_path / "no-shebang"
    script.write_text("echo hello\n")
    script.chmod(0o755)
    done = subprocess.run(
        [ACCELSCHED, "simulate", "--gpus", "1", "--", str(script)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "Traceback" not in done.stderr
    assert done.returncode == 126


# --- NVML ---------------------------------------------------------------------------------


class _LostHandleNVML:
    """NVML where GPU 1 is lost: nvmlDeviceGetHandleByIndex fails for it, as real NVML
    does (NVML_ERROR_GPU_IS_LOST); the fake driver only fails queries on a handle."""

    class NVMLError(Exception):
        pass

    def nvmlInit(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        if i == 1:
            raise self.NVMLError("GPU is lost")
        return i

    def nvmlDeviceGetUUID(self, h: int) -> str:
        return f"GPU-0000000{h}-0000-0000-0000-000000000000"

    def nvmlDeviceGetName(self, h: int) -> str:
        return "Probe GPU"

    def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:
        return type("Memory", (), {"total": 2**34, "used": 0, "free": 2**34})()

    def nvmlDeviceGetComputeRunningProcesses(self, h: int) -> list:
        return []

    def nvmlDeviceGetMigMode(self, h: int) -> Any:
        raise self.NVMLError("not supported")


def test_one_lost_gpu_at_listing_costs_only_itself(monkeypatch):
    from accelsched import devices

    monkeypatch.setattr(devices, "load_backend", lambda: _LostHandleNVML())
    monitor = devices.NVMLMonitor(env={})
    assert [d.index for d in monitor.devices()] == [0]
    assert monitor.left_out == [1]
