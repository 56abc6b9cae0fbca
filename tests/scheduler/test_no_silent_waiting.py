"""No silent waiting: a GPU task no verified GPU can take is said, and a ``dual`` step
falls back by default (docs/fallback.md, docs/observe.md).

Plain distributed leaves such a task waiting for ever without a word; a ``dual`` step
has a CPU form, so accelsched runs it after
:data:`~accelsched.policy.timeouts.DUAL_TIMEOUT` unless told otherwise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import dask
import pytest
from distributed import Nanny, wait
from distributed.utils_test import gen_cluster

import accelsched
from accelsched.display import summary
from accelsched.events import describe
from accelsched.policy.timeouts import (
    DUAL_TIMEOUT,
    NO_ELIGIBLE_WORKER,
    NO_GPU,
    NOTICE_AFTER,
    TOO_FEW_GPUS,
    UNMET_REQUIREMENT,
    Notices,
    reason_for,
)
from accelsched.protocol import PLACEMENT_PLUGIN
from tests import processes
from tests.processes import running
from tests.utils import ACCELSCHED, ROOT, events, gpus, wait_for

# --- decisions, in numbers --------------------------------------------------------------


def test_why_a_gpu_task_waits() -> None:
    assert reason_for(1, 0, False) == NO_GPU
    assert reason_for(1, 0, True) == NO_GPU  # no GPU at all says more than a requirement
    assert reason_for(2, 1, False) == TOO_FEW_GPUS
    assert reason_for(1, 1, True) == UNMET_REQUIREMENT  # no device anywhere meets it
    assert reason_for(1, 2, False) == NO_ELIGIBLE_WORKER  # e.g. workers= elsewhere
    # a requirement some device meets (declared memory takes no whole GPU): its workers
    # have none for it, or not the room it declares
    assert reason_for(0, 1, False) == NO_ELIGIBLE_WORKER
    assert 0 < NOTICE_AFTER <= 5  # "within a few seconds"


def test_each_reason_is_said_once_and_again_after_it_drained() -> None:
    notices = Notices()
    assert notices.update([NO_GPU]) == [NO_GPU]
    assert notices.update([NO_GPU]) == []  # still waiting, more or fewer: said already
    assert notices.update([NO_GPU, TOO_FEW_GPUS]) == [TOO_FEW_GPUS]
    assert notices.update([TOO_FEW_GPUS]) == []
    assert notices.update([]) == []
    assert notices.update([NO_GPU, TOO_FEW_GPUS]) == [NO_GPU, TOO_FEW_GPUS]


def test_dual_takes_fallback_timeout_as_gpu_does() -> None:
    assert accelsched.dual(abs, abs).__accelsched_gpu__.cpu_form == DUAL_TIMEOUT
    assert DUAL_TIMEOUT <= 60  # documented: at most a minute
    strict = accelsched.dual(abs, abs, fallback_timeout=None).__accelsched_gpu__
    assert strict.timeout is None and strict.timeout_given
    assert accelsched.dual(abs, abs, fallback_timeout="5s").__accelsched_gpu__.timeout == 5
    assert accelsched.gpu(abs).__accelsched_gpu__.cpu_form is None  # GPU-only: strict
    for bad in ("bogus", -1, float("nan"), "1e400s"):
        with pytest.raises(ValueError, match=r"dual\(\): invalid fallback_timeout"):
            accelsched.dual(abs, abs, fallback_timeout=bad)


# --- in one process ---------------------------------------------------------------------


def on_gpu(i: int) -> str:
    return "gpu"


def on_host(i: int) -> str:
    return "cpu"


@accelsched.gpu
def gpu_only(i: int) -> str:
    return "gpu-only"


def timeouts(plugin: Any) -> Callable[[str], float | None]:
    """The timeout the scheduler's record of each GPU task says it lives by."""
    return lambda key: plugin.fallback.tasks[key].timeout


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)], timeout=60)
async def test_a_dual_step_with_no_gpu_is_said_and_falls_back(c, s, a):
    """No worker has a GPU: the waiting tasks are counted by reason and said once;
    a dual step's default timeout is DUAL_TIMEOUT, a plugin's default wins over it, its
    own wins over both, ``None`` keeps it strict; a GPU-only step stays strict."""
    await accelsched.register(c)
    plugin = s.plugins[PLACEMENT_PLUGIN]
    step = accelsched.dual(on_gpu, on_host)
    waiting = c.map(step, range(3), key=[f"dual-{i}" for i in range(3)])
    strict = c.submit(accelsched.dual(on_gpu, on_host, fallback_timeout=None), 0, key="s-0")
    only = c.submit(gpu_only, 0, key="only-0")
    quick = c.submit(accelsched.dual(on_gpu, on_host, fallback_timeout="1s"), 0, key="q-0")
    assert await quick == "cpu"  # its own timeout
    timeout_of = timeouts(plugin)
    assert [timeout_of(f"dual-{i}") for i in range(3)] == [DUAL_TIMEOUT] * 3
    assert timeout_of("s-0") is None and timeout_of("only-0") is None
    await wait_for(lambda: events(s, "gpu-waiting"), timeout=NOTICE_AFTER + 5)
    (said,) = events(s, "gpu-waiting")
    assert said["reason"] == NO_GPU and said["waiting"] == 5, said
    assert set(said["keys"]) <= {"dual-0", "dual-1", "dual-2", "s-0", "only-0"}
    snap = plugin.status_history.snapshot()
    assert snap["waiting"] == {NO_GPU: 5}, snap
    assert describe(said).startswith("5 GPU task(s) wait unplaced: no worker has a verified GPU")
    assert "5 GPU tasks waiting (5 no-verified-gpu)" in summary(snap)  # status, dashboard
    await c.cancel([strict, only, *waiting])
    await wait_for(lambda: not plugin.status_history.snapshot()["waiting"])
    assert len(events(s, "gpu-waiting")) == 1  # said once per reason, not per task


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)], timeout=60)
async def test_the_plugins_default_timeout_applies_to_dual_steps(c, s, a):
    await accelsched.register(c, fallback_timeout="1s")
    plugin = s.plugins[PLACEMENT_PLUGIN]
    step = accelsched.dual(on_gpu, on_host)
    d = c.submit(step, 0, key="d-0")
    assert await d == "cpu"
    assert timeouts(plugin)("d-0") == 1
    own = accelsched.dual(on_gpu, on_host, fallback_timeout=None)
    f = c.submit(own, 0, key="strict-0")
    await wait_for(lambda: "strict-0" in s.tasks and s.tasks["strict-0"].state == "no-worker")
    assert timeouts(plugin)("strict-0") is None  # its own None wins
    await c.cancel([d, f])


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)], timeout=60)
async def test_an_annotated_task_calling_a_dual_step_keeps_its_cpu_form(c, s, a):
    """``resources={"GPU": 1}`` on a task that calls a dual step: the step still gives
    its timeout (its default, or its own); a ``fallback_timeout`` annotation wins."""
    await accelsched.register(c)
    plugin = s.plugins[PLACEMENT_PLUGIN]
    step = accelsched.dual(on_gpu, on_host)
    f = c.submit(step, 0, key="ann-0", resources={"GPU": 1})
    quick = accelsched.dual(on_gpu, on_host, fallback_timeout="1s")
    h = c.submit(quick, 0, key="ann-1", resources={"GPU": 1})
    assert await h == "cpu"
    with dask.annotate(fallback_timeout=None):
        g = c.submit(step, 0, key="ann-2", resources={"GPU": 1})
    await wait_for(lambda: all(k in s.tasks for k in ("ann-0", "ann-2")))
    timeout_of = timeouts(plugin)
    assert (timeout_of("ann-0"), timeout_of("ann-1"), timeout_of("ann-2")) == (
        DUAL_TIMEOUT,
        1,
        None,
    )
    await c.cancel([f, g, h])


# --- as users run it --------------------------------------------------------------------

CLIENT = """
import json, subprocess, sys, time
from distributed import Client
import accelsched

def gpu_fn(i):
    return ("gpu", i)

def cpu_fn(i):
    return ("cpu", i)

if __name__ == "__main__":
    client = Client(sys.argv[1], timeout=30)
    futures = client.map(accelsched.dual(gpu_fn, cpu_fn), range(4))
    said = []
    while not said:  # the scheduler says why they wait, within a few seconds
        said = [m for _, m in client.get_events("accelsched") if m["action"] == "gpu-waiting"]
        time.sleep(0.2)
    status = subprocess.run(
        [sys.argv[2], "status", sys.argv[1], "--json"], capture_output=True, text=True
    )
    start = time.monotonic()
    results = client.gather(futures)
    print(json.dumps({"said": said, "status": json.loads(status.stdout),
                      "results": results, "after": time.monotonic() - start}))
"""


def test_a_dual_pipeline_with_no_gpu_worker_on_a_command_line_cluster(tmp_path: Path) -> None:
    """``dask scheduler --preload accelsched`` and a plain ``dask worker``, every option
    at its default; the client a script whose steps live in ``__main__``."""
    paths = [str(ROOT)]
    sched = processes.scheduler(tmp_path, "--preload", "accelsched", paths=paths, cwd=tmp_path)
    with running(sched):
        address = processes.scheduler_address(tmp_path / "scheduler.json", sched)
        worker = processes.worker(
            tmp_path, "cpu", address, env={"CUDA_VISIBLE_DEVICES": ""}, paths=paths, cwd=tmp_path
        )
        with running(worker):
            (tmp_path / "pipeline.py").write_text(CLIENT)
            done = subprocess.run(
                [sys.executable, "pipeline.py", address, ACCELSCHED],
                cwd=tmp_path,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
                capture_output=True,
                text=True,
                timeout=DUAL_TIMEOUT + 60,
            )
            logs = sched.output()[-3000:] + worker.output()[-3000:]
    assert done.returncode == 0, done.stderr[-4000:] + logs
    out = json.loads(done.stdout.splitlines()[-1])
    assert out["results"] == [["cpu", i] for i in range(4)], out
    (said,) = out["said"]
    assert said["reason"] == NO_GPU and said["waiting"] == 4, said
    assert out["status"]["waiting"] == {NO_GPU: 4}, out["status"]
    assert out["after"] < DUAL_TIMEOUT + 10


@accelsched.gpu(memory="10GiB")
def holds_ten(i: int) -> object:
    from accelsched.testing import device_alloc

    return device_alloc(10 * 2**30)  # left on the device while the client holds it


@accelsched.gpu(memory="10GiB")
def needs_ten(i: int) -> int | None:
    return accelsched.current_device()


GPU_AND_CPU = [
    ("127.0.0.1", 1, {"env": {"CUDA_VISIBLE_DEVICES": "0"}, "resources": {"GPU": 1}}),
    ("127.0.0.1", 1, {"env": {"CUDA_VISIBLE_DEVICES": ""}}),
]


@pytest.mark.usefixtures("fake_gpus_2")
@gen_cluster(
    client=True, Worker=Nanny, nthreads=GPU_AND_CPU, timeout=90, worker_kwargs={"memory_limit": 0}
)
async def test_a_requirement_some_device_meets_waits_for_its_workers_or_room(c, s, gpu, cpu):
    """A 10 GiB task (a 16 GiB device meets it) waits restricted to the worker without a
    GPU, then behind a 10 GiB result held on the one device: both times it is said to wait
    for its workers or their room, never for a requirement no device meets; it runs once
    the result goes (before: ``unmet-requirement``, whatever it waited for). The workers
    keep every result in memory (no spilling: a spilled result frees its device)."""
    await accelsched.register(c, fast_restart=False)
    await wait_for(lambda: gpus(s, gpu.worker_address) == 1)
    fallback = s.plugins[PLACEMENT_PLUGIN].fallback
    restricted = c.submit(needs_ten, 0, workers=[cpu.worker_address], pure=False)
    await wait_for(lambda: fallback.waiting() == {NO_ELIGIBLE_WORKER: [restricted.key]})
    await wait_for(lambda: events(s, "gpu-waiting"))
    assert [e["reason"] for e in events(s, "gpu-waiting")] == [NO_ELIGIBLE_WORKER]
    await c.cancel(restricted)
    held = c.submit(holds_ten, 0, pure=False)
    await wait(held)
    later = c.submit(needs_ten, 1, pure=False)
    await wait_for(lambda: fallback.waiting() == {NO_ELIGIBLE_WORKER: [later.key]})
    assert not events(s, "unmet-requirement")
    del held
    assert await later == 0
