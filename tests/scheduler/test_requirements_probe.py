"""Requirements under misuse and faults: what a careless user, an odd worker report or a
failing device must not do to placement.

The cluster tests run nanny workers on mixed simulated GPUs (an 80 GiB H100 and a
40 GiB A100), as tests/scheduler/test_requirements_placement.py does.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

import dask
import pytest
from distributed import Nanny
from distributed.diagnostics.plugin import SchedulerPlugin
from distributed.utils_test import gen_cluster

import accelsched
from accelsched.policy.requirements import parse_requirement
from tests.scheduler.test_requirements_placement import (
    A100,
    H100,
    WORKERS,
    _register,
    _verified,
    large,
    small,
    where,
)
from tests.utils import events, wait_for

pytestmark = pytest.mark.usefixtures("mixed_gpus")

GiB = 2**30
#: One nanny worker owning both devices (CUDA 0: the H100, 1: the A100).
BOTH = [("127.0.0.1", 4, {"env": {"CUDA_VISIBLE_DEVICES": "0,1"}, "resources": {"GPU": 2}})]


class SentBack(SchedulerPlugin):
    """Counts the tasks workers sent back (distributed's ``Reschedule``)."""

    def __init__(self) -> None:
        self.count = 0

    def transition(self, key: Any, start: str, finish: str, *args: Any, **kwargs: Any) -> None:
        if (start, finish) == ("processing", "released") and str(
            kwargs.get("stimulus_id", "")
        ).startswith("reschedule"):
            self.count += 1


def _device_name() -> str:
    return where()[0]


@accelsched.gpu(model="*NVIDIA*")
def anywhere(_: int) -> tuple[str, int | None, float]:
    return where()


@accelsched.gpu(memory="100GiB", fallback_timeout="300ms")
def too_large(_: int) -> str:
    return "gpu" if accelsched.current_device() is not None else "cpu"


# --- values: every bad one is named -------------------------------------------------------


@pytest.mark.parametrize("memory", ["1e400", "1e400GiB", 10**5000], ids=["1e400", "GiB", "huge"])
def test_an_overflowing_memory_is_named(memory: object) -> None:
    with pytest.raises(ValueError, match="invalid GPU requirement memory="):
        parse_requirement({"memory": memory})
    with pytest.raises(ValueError, match=r"^gpu\(\): invalid GPU requirement memory="):
        accelsched.gpu(memory=memory)(_device_name)


# --- a task no device of its worker can hold is not sent back and forth -------------------


@gen_cluster(client=True, Worker=Nanny, nthreads=BOTH, timeout=90)
async def test_a_requirement_one_worker_only_seems_to_meet_is_unmet_not_bounced(c, s, a):
    """Two A100s wanted where there is one; 79 GiB declared where a device has 80 GiB, of
    which 78 may be declared: the worker can never hold either. Each is said unmet and
    runs its CPU form after its timeout; no worker sends it back and forth meanwhile."""
    await _register(c)
    await wait_for(lambda: len(events(s, "gpu-verified")) == 1)
    sent_back = SentBack()
    s.add_plugin(sent_back, name="sent-back")
    ask = {"resources": {"GPU": 2}, "gpu": {"model": "*A100*"}, "fallback_timeout": "1s"}
    with dask.annotate(**ask):
        two = c.submit(accelsched.current_device, pure=False)
    ask = {"resources": {"GPU": 1}, "gpu": {"memory": "79GiB"}, "fallback_timeout": "1s"}
    with dask.annotate(**ask):
        over = c.submit(accelsched.current_device, pure=False)
    assert await asyncio.wait_for(c.gather([two, over]), 20) == [None, None]
    assert sent_back.count == 0
    unmet = {e["requirement"] for e in events(s, "unmet-requirement")}
    assert unmet == {"model=*A100*", "memory>=79GiB"}


@gen_cluster(client=True, Worker=Nanny, nthreads=BOTH, timeout=90)
async def test_a_task_whose_device_was_withdrawn_is_not_bounced(c, s, a, mixed_gpus):
    """The H100 fails and is withdrawn: a task only it meets is sent back once, not
    again and again, and runs its CPU form after its timeout."""
    await accelsched.register(c, check_interval="100ms", fast_restart=False)
    await wait_for(lambda: len(events(s, "gpu-verified")) == 1)
    sent_back = SentBack()
    s.add_plugin(sent_back, name="sent-back")
    mixed_gpus.fail(0)
    await wait_for(lambda: s.workers[a.worker_address].resources.get("GPU") == 1, timeout=30)
    ask = {"resources": {"GPU": 1}, "gpu": {"memory": "30GiB", "model": "*H100*"}}
    with dask.annotate(**ask, fallback_timeout="1s"):
        fut = c.submit(accelsched.current_device, pure=False)
    assert await asyncio.wait_for(fut, 20) is None  # its CPU form
    assert sent_back.count <= 1
    # the A100 still takes what it meets
    with dask.annotate(resources={"GPU": 1}, gpu={"memory": "8GiB"}):
        assert await asyncio.wait_for(c.submit(_device_name, pure=False), 20) == A100


# --- what the user wrote counts, all of it --------------------------------------------------


@gen_cluster(client=True, Worker=Nanny, nthreads=WORKERS, timeout=90)
async def test_a_hard_worker_restriction_is_kept(c, s, a, b):
    """workers=[a] and a requirement both workers meet: every task runs on a; a task
    that falls back runs its CPU form on a too."""
    await _verified(c, s)
    futures = c.map(anywhere, range(8), workers=[a.worker_address], pure=False)
    await c.gather(futures)
    who = await c.who_has(futures)
    assert {w for ws in who.values() for w in ws} == {a.worker_address}
    fell = c.submit(too_large, 1, workers=[b.worker_address], pure=False)
    assert await fell == "cpu"
    assert set((await c.who_has([fell]))[fell.key]) == {b.worker_address}


@gen_cluster(client=True, Worker=Nanny, nthreads=WORKERS, timeout=90)
async def test_a_steps_requirement_holds_under_a_resources_annotation(c, s, a, b):
    """``dask.annotate(resources={"GPU": 1})`` around a marked step does not drop what
    the step asks of its device; an annotated requirement and the step's combine."""
    await _verified(c, s)
    with dask.annotate(resources={"GPU": 1}):
        results = await c.gather(c.map(large, range(6), pure=False))  # 60 GiB: the H100
    assert {name for name, _, _ in results} == {H100}
    with dask.annotate(resources={"GPU": 1}, gpu={"model": "*H100*"}):
        clash = c.submit(small, 1, pure=False)  # the step asks for an A100
    with pytest.raises(ValueError, match=r"conflicting.*model=\*A100\*.*model=\*H100\*"):
        await clash


@gen_cluster(client=True, Worker=Nanny, nthreads=WORKERS, timeout=90)
async def test_a_gpu_annotation_that_cannot_count_errs_naming_it(c, s, a, b):
    """A requirement on a task that asks for no GPU, or one that is no mapping but is
    falsy (0, "", [], False), is not silently dropped: that task errs, naming it."""
    await _verified(c, s)
    with dask.annotate(gpu={"model": "*H100*"}):
        bare = c.submit(_device_name, pure=False)
    with pytest.raises(ValueError, match=r"gpu=\{'model': '\*H100\*'\}.*resources"):
        await bare
    for falsy in (0, "", [], False):
        with dask.annotate(resources={"GPU": 1}, gpu=falsy):
            odd = c.submit(_device_name, pure=False)
        with pytest.raises(ValueError, match=re.escape(f"invalid GPU requirement {falsy!r}")):
            await odd
    with dask.annotate(resources={"GPU": 1}, gpu={}):  # "anything goes"
        assert await c.submit(_device_name, pure=False) in (H100, A100)


# --- faults and odd reports -----------------------------------------------------------------


@gen_cluster(client=True, Worker=Nanny, nthreads=WORKERS[1:], timeout=90)
async def test_re_registering_keeps_requirement_tasks_placeable(c, s, b):
    """Unregistering and registering again (docs: to change options) while a task waits
    for a device no worker has: the worker that joins with one runs it."""
    await _register(c)
    await wait_for(lambda: len(events(s, "gpu-verified")) == 1)
    with dask.annotate(resources={"GPU": 1}, gpu={"model": "*H100*"}):
        waiting = c.submit(_device_name, pure=False)
    await wait_for(lambda: waiting.key in s.tasks and s.tasks[waiting.key].state == "no-worker")
    await c.unregister_worker_plugin("accelsched-guard")
    await c.unregister_scheduler_plugin("accelsched-placement")
    await _register(c)
    h100 = {"env": {"CUDA_VISIBLE_DEVICES": "0"}, "resources": {"GPU": 1}}
    async with Nanny(s.address, nthreads=2, **h100):
        assert await asyncio.wait_for(waiting, 30) == H100


@gen_cluster(client=True, Worker=Nanny, nthreads=WORKERS, timeout=90)
async def test_an_odd_device_report_is_refused_and_harms_nobody(c, s, a, b):
    """A worker sends a report of its own with a device whose memory is no number:
    the report is refused, and placement, status and other workers' tasks go on."""
    from accelsched.display import render

    await _verified(c, s)
    plugin = s.plugins["accelsched-placement"]
    odd = {"index": 0, "uuid": "GPU-odd", "name": "odd", "memory": "lots", "capability": "9"}
    reply = plugin.reports.handle_inventory(
        None,
        worker=a.worker_address,
        devices=[odd],
        process=s.workers[a.worker_address].server_id,  # from its own process
        request="r",
        declared=1,
        requested=1,
    )
    assert reply["status"] == "refused"
    with dask.annotate(resources={"GPU": 1}, gpu={"model": "*A100*"}):
        assert await c.submit(_device_name, pure=False) == A100
    render(plugin.status_history.snapshot())


def test_a_requirement_the_worker_cannot_read_errs_its_task_and_binds_nothing() -> None:
    """A requirement no scheduler plugin normalised (the task reached the worker as the
    client wrote it) is read on the worker's event loop: a bad one must not raise there,
    where distributed would log it and run the GPU task with no device bound."""
    from accelsched.worker.guard_plugin import Binder

    binder = Binder(oom_exceptions=(), pools=None, emit=lambda *a, **k: None)  # type: ignore[arg-type]
    binder.set_devices([0])
    runner = binder.gpu_runner("k", 1, "k", {"memroy": "1GiB"})
    with pytest.raises(ValueError, match="unknown GPU requirement key.*'memroy'"):
        runner(lambda values: 1, {})
    assert len(binder.leases.holders()) == 0


def test_a_gpu_task_whose_room_is_split_waits_in_its_thread_for_a_lease_to_end() -> None:
    """The lease table only answers that no device has room now; the binder waits, in
    the task's thread, until a lease ends, then runs it on the device that came free."""
    import threading
    import types

    from accelsched.context import current_device
    from accelsched.policy.requirements import DeviceFacts, Requirement
    from accelsched.worker.guard_plugin import Binder

    pools = types.SimpleNamespace(after_gpu_task=lambda devices: None)
    binder = Binder(oom_exceptions=(), pools=pools, emit=lambda *a, **k: None)  # type: ignore[arg-type]
    binder.leases.set_devices(
        [0, 1],
        {0: DeviceFacts("NVIDIA H100", 80 * GiB, (9, 0)), 1: DeviceFacts("A100", 40 * GiB, (8, 0))},
    )
    gate = threading.Event()

    def held(values: Any) -> int | None:
        gate.wait(10)
        return current_device()

    got: list[int | None] = []
    fill = binder.gpu_runner("a", 0, "a", {"memory": 38 * GiB, "model": "*A100*"})
    holder = threading.Thread(target=lambda: got.append(fill(held, {})))
    holder.start()
    assert binder.leases.grant("b", 0, Requirement(memory=70 * GiB)) == (0,)
    small = binder.gpu_runner("c", 0, "c", {"memory": 10 * GiB})
    waiter = threading.Thread(target=lambda: got.append(small(lambda v: current_device(), {})))
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive() and not got  # 6 GiB left on one, 0 on the other: it waits
    gate.set()
    holder.join(5)
    waiter.join(5)
    assert got == [1, 1] and binder.leases.holders() == {"b": (0,)}
