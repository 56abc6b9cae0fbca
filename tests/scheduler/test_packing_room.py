"""Packing that counts what is on a device: results held there, and other workers
sharing it. Simulated 16 GiB GPUs (15.2 GiB declarable each), nanny workers."""

from __future__ import annotations

import asyncio
import logging
import time
from unittest import mock

import pytest
from distributed import Event, Nanny, Worker, wait
from distributed.core import rpc
from distributed.utils_test import captured_logger, gen_cluster

import accelsched
from accelsched import internals
from accelsched.protocol import GPU, GPU_MEMORY, GUARD_PLUGIN, OFFER_HANDLER
from accelsched.scheduler import grants
from tests.utils import GPU_WORKER, events, gpus, wait_for

pytestmark = pytest.mark.usefixtures("fake_gpus_2")

GiB = 2**30
MiB = 2**20
#: a 16 GiB device's capacity (less its reserve, whole MiB), shared by two: 7782 MiB
_half = (16 * GiB - 16 * GiB // 20) // MiB // 2 * MiB
OWN_DEVICES = [
    ("127.0.0.1", 4, {"env": {"CUDA_VISIBLE_DEVICES": "0"}, "resources": {"GPU": 1}}),
    ("127.0.0.1", 4, {"env": {"CUDA_VISIBLE_DEVICES": "1"}, "resources": {"GPU": 1}}),
]
ONE_DEVICE = [
    ("127.0.0.1", 4, {"env": {"CUDA_VISIBLE_DEVICES": "0"}, "resources": {"GPU": 1}}),
    ("127.0.0.1", 4, {"env": {"CUDA_VISIBLE_DEVICES": "0"}, "resources": {"GPU": 1}}),
]


@accelsched.gpu(memory="10GiB")
def ten_gib_result() -> object:
    from accelsched.testing import device_alloc

    return device_alloc(10 * GiB)  # left on the device while the client holds it


def _honest(declared: int):  # type: ignore[no-untyped-def]
    @accelsched.gpu(memory=f"{declared}GiB")
    def step(i: int) -> tuple[float, float]:
        """Takes what it declared, holds it a while, gives it back."""
        from accelsched.testing import device_alloc

        start = time.time()
        buf = device_alloc(declared * GiB)
        time.sleep(0.5)
        del buf
        return start, time.time()

    step.__name__ = step.__qualname__ = f"honest_{declared}"
    return step


def on_gpu(i: int) -> str:
    return "gpu"


def on_cpu(i: int) -> str:
    return "cpu"


async def _register(c, s, verified: int = 2, **options) -> None:  # type: ignore[no-untyped-def]
    await accelsched.register(c, check_interval="1h", fast_restart=False, **options)
    await wait_for(lambda: len(events(s, "gpu-verified")) == verified)


def _memory(s, w) -> float:  # type: ignore[no-untyped-def]
    return s.workers[w.worker_address].resources.get("GPU-memory", 0)


@gen_cluster(client=True, Worker=Nanny, nthreads=OWN_DEVICES, timeout=90)
async def test_results_held_on_a_device_are_not_packed_into(c, s, a, b):
    """A 10 GiB result held on a's device: 8 GiB tasks go to b (packed beside the result
    they ran out of device memory); one that may run only on a waits for the result to be
    released, then runs there."""
    await _register(c, s)
    held = c.submit(ten_gib_result, workers=[a.worker_address], pure=False)
    await wait(held)  # not fetched: the client has no device to hold it on
    eight = _honest(8)
    spans = await c.gather(c.map(eight, range(3), pure=False))  # no OutOfDeviceMemory
    assert len(spans) == 3
    assert _memory(s, a) < 6 * 1024  # a offers 15.2 GiB less the 10 GiB its result holds
    who = await c.who_has(held)
    assert list(who.values()) == [(a.worker_address,)]
    on_a = c.submit(eight, 99, workers=[a.worker_address], pure=False)
    await wait_for(lambda: on_a.key in s.tasks and s.tasks[on_a.key].state == "no-worker")
    released = time.time()
    del held
    start, _ = await on_a  # runs once the result went
    assert start >= released
    assert _memory(s, a) > 15 * 1024


@gen_cluster(client=True, Worker=Nanny, nthreads=ONE_DEVICE, timeout=90)
async def test_workers_sharing_a_device_pack_it_to_its_capacity_together(c, s, a, b):
    """Two workers granted one 16 GiB device (share_gpus): each packs half its capacity,
    so four honest 6 GiB tasks never run three at once (each worker packed two: 24 GiB
    on 16, two ran out of device memory). One sharer gone, the other has it all."""
    await _register(c, s, share_gpus=True)
    spans = await c.gather(c.map(_honest(6), range(4), pure=False))  # no OutOfDeviceMemory
    assert _memory(s, a) == _memory(s, b) < 8 * 1024
    at_once = max(sum(st <= t < en for st, en in spans) for t, _ in spans)
    assert at_once <= 2, spans
    await b.close()
    await wait_for(lambda: _memory(s, a) > 15 * 1024)
    # a packs the whole device again: two 6 GiB tasks side by side
    gate = Event("hold-two")

    @accelsched.gpu(memory="6GiB")
    def waits(i: int) -> float:
        Event("hold-two").wait(30)
        return time.time()

    two = c.map(waits, range(2), pure=False)
    await wait_for(lambda: len(s.workers[a.worker_address].executing) == 2)
    await gate.set()
    await c.gather(two)


@gen_cluster(client=True, Worker=Nanny, nthreads=ONE_DEVICE, timeout=90)
async def test_a_sharer_learning_its_share_late_packs_nothing_past_it(c, s, a, b):
    """The first worker verified packs the whole device until an offer tells it of the
    second: the second's share is what the first leaves meanwhile (none), and grows once
    the first says it packs within its half. Here the scheduler's request to offer again
    is held back 4 s, as a busy worker would answer it (the race cannot be timed from a
    test): four honest 6 GiB tasks submitted at once still never run three at a time."""
    ask = grants.DeviceReports._ask_report

    async def late(self: grants.DeviceReports, addr: str) -> None:
        await asyncio.sleep(4)
        await ask(self, addr)

    with mock.patch.object(grants.DeviceReports, "_ask_report", late):
        await _register(c, s, share_gpus=True)
        spans = await c.gather(c.map(_honest(6), range(4), pure=False))  # no OutOfDeviceMemory
    at_once = max(sum(st <= t < en for st, en in spans) for t, _ in spans)
    assert at_once <= 2, spans
    await wait_for(lambda: _memory(s, a) == _memory(s, b) > 7 * 1024)


@gen_cluster(client=True, Worker=Nanny, nthreads=ONE_DEVICE[:1], timeout=90)
async def test_a_sharer_joining_waits_for_the_room_tasks_running_hold(c, s, a):
    """a packs two 6 GiB tasks on its device alone; b joins to share it (a's share: half
    now, 7.6 GiB). b may take only what a's running tasks leave (3.2 GiB): its 6 GiB
    tasks wait for them to end, then run, and nothing runs out of device memory."""
    await _register(c, s, share_gpus=True, verified=1)

    @accelsched.gpu(memory="6GiB")
    def holds(i: int) -> float:
        from accelsched.testing import device_alloc

        buf = device_alloc(6 * GiB)
        Event("let-go").wait(30)
        del buf
        return time.time()

    two = c.map(holds, range(2), pure=False)
    await wait_for(lambda: len(s.workers[a.worker_address].executing) == 2)
    async with Nanny(s.address, nthreads=4, **ONE_DEVICE[1][2]) as b:
        await wait_for(lambda: len(events(s, "gpu-verified")) == 2)
        on_b = c.map(_honest(6), range(2), workers=[b.worker_address], pure=False)
        await wait_for(lambda: 0 < _memory(s, b) < 4 * 1024)  # 15.2 less a's 12 GiB
        await asyncio.sleep(1)
        assert all(f.status == "pending" for f in on_b)
        await Event("let-go").set()
        ended = max(await c.gather(two))
        spans = await c.gather(on_b)  # no OutOfDeviceMemory
        assert min(st for st, _ in spans) >= ended - 0.5, (spans, ended)
        await wait_for(lambda: _memory(s, a) == _memory(s, b) > 7 * 1024)


@gen_cluster(client=True, Worker=Nanny, nthreads=ONE_DEVICE + ONE_DEVICE[:1], timeout=120)
async def test_three_sharers_through_a_restart_never_overpack_and_settle_even(c, s, a, b, d):
    """Three workers share one device (5.1 GiB each). Honest 4 GiB tasks stream through
    while one sharer restarts (its room passes to the other two, then back): never four
    at once, none out of device memory, and the three settle on a third each."""
    await _register(c, s, verified=3, share_gpus=True)
    four = _honest(4)
    first = c.map(four, range(12), pure=False)
    await wait_for(lambda: any(f.status == "finished" for f in first))
    await c.restart_workers([b.worker_address])
    # the nanny learns its new worker's address a moment after the scheduler does
    await wait_for(lambda: b.worker_address in s.workers)
    spans = await c.gather(first + c.map(four, range(12, 24), pure=False))
    at_once = max(sum(st <= t < en for st, en in spans) for t, _ in spans)
    assert at_once <= 3, spans
    third = (16 * GiB - 16 * GiB // 20) // MiB // 3  # MiB
    await wait_for(lambda: [_memory(s, w) for w in (a, b, d)] == [third] * 3)


@gen_cluster(client=True, nthreads=GPU_WORKER * 2, Worker=Worker, timeout=60)
async def test_an_offer_unanswered_keeps_the_share_last_told(c, s, a, b):
    """Two workers share one device (7.6 GiB each). An offer that gets no answer (the
    scheduler's handler taken away here: a lost call reads the same) leaves the worker
    packing within the share it was last told, not the whole device; a device it was
    not told of yet gets no room until a reply names it."""
    await _register(c, s, share_gpus=True)
    inv = a.plugins[GUARD_PLUGIN].inventory
    await wait_for(lambda: inv.told and set(inv.shares.values()) == {_half})
    memory = a.state.total_resources[GPU_MEMORY]
    assert memory == _half // MiB
    handler = s.plugins["accelsched-placement"].reports.handle_offer
    internals.remove_handler(s, OFFER_HANDLER, handler)
    try:
        await inv.offer(a.plugins[GUARD_PLUGIN]._use_devices)
    finally:
        internals.install_handler(s, OFFER_HANDLER, handler)
    assert set(inv.shares.values()) == {_half}
    assert a.state.total_resources[GPU_MEMORY] == memory
    # a device not told of yet (back from withdrawal, say) waits for the reply naming it
    assert inv.shares_of([*inv.shares, 7]) == {**inv.shares, 7: 0}


@gen_cluster(client=True, nthreads=GPU_WORKER, Worker=Worker, timeout=60)
async def test_an_offer_saying_oddly_what_results_hold_is_invalid(c, s, a):
    """What results hold comes off the room declared tasks are placed against, and what
    a worker's tasks may take off its sharers': anything but bytes per UUID changes
    nothing."""
    await accelsched.register(c)
    await wait_for(lambda: gpus(s, a.address) == 1)
    before = dict(s.workers[a.address].resources)
    (uuid,) = s.plugins["accelsched-placement"].grants.uuids(a.address)
    async with rpc(s.address) as r:
        odds = [[1], {uuid: -1}, {uuid: 1.5}, {uuid: True}, {1: 1}, "x", {"GPU-elsewhere": 1}]
        for n, odd in enumerate(odds):
            said = {"worker": a.address, "process": a.id, "request": f"odd-{n}"}
            reply = await getattr(r, OFFER_HANDLER)(**said, count=1, uuids=[uuid], held=odd)
            assert reply == {"status": "invalid", "count": 0}, odd
            said["request"] = f"odd-packs-{n}"
            reply = await getattr(r, OFFER_HANDLER)(**said, count=1, uuids=[uuid], packs=odd)
            assert reply == {"status": "invalid", "count": 0}, odd
        said = {"worker": a.address, "process": a.id, "request": "fine"}
        reply = await getattr(r, OFFER_HANDLER)(**said, count=1, uuids=[uuid], held={uuid: GiB})
        assert reply["status"] == "OK" and reply["shares"] == {uuid: 15564 * MiB}
        assert reply["memory"] == before["GPU-memory"] - 1024
    assert s.workers[a.address].resources["GPU-memory"] == before["GPU-memory"] - 1024


@gen_cluster(client=True, nthreads=[("", 2, {"resources": {GPU: 1, GPU_MEMORY: 1024}})])
async def test_a_task_that_arrives_before_the_offer_reply_runs_once_it_comes(c, s, a):
    """The scheduler places tasks on a guard's offer before its reply, from which the
    worker sets its own figures, reaches the worker. A task that arrives between waits in
    distributed's queue of tasks short of resources, which it looks at again only when
    some task ends: here none would. The race cannot be timed from a test, so the
    worker's own figure is set back by hand, as it stands before the reply."""
    a.state.total_resources[GPU_MEMORY] = a.state.available_resources[GPU_MEMORY] = 0
    step = c.submit(lambda: 42, resources={GPU: 1, GPU_MEMORY: 1024}, pure=False)
    await wait_for(lambda: step.key in a.state.tasks)
    assert a.state.tasks[step.key].state == "constrained"
    await internals.set_own_gpus(a, 1, 1024)  # what the guard does with the reply
    assert await step == 42


@gen_cluster(client=True, Worker=Nanny, nthreads=ONE_DEVICE, timeout=90)
async def test_a_need_a_mib_over_a_share_falls_back_and_one_within_it_runs(c, s, a, b):
    """Two workers share one device (7782 MiB each). A dual step declaring a MiB more
    than a share is placed nowhere: it falls back once its timeout passes, never sent to
    a worker. One declaring the share exactly runs on the device. (The room placed
    against was rounded up to whole MiB: the first was placed, sent back by the worker's
    lease table, placed again, for ever, its timeout never reached.)"""
    await _register(c, s, share_gpus=True)
    await wait_for(lambda: _memory(s, a) == _memory(s, b) == _half // MiB == 7782)
    over = accelsched.dual(on_gpu, on_cpu, memory=_half + MiB, fallback_timeout="2s")
    start = time.monotonic()
    future = c.submit(over, 1, pure=False)
    assert await future == "cpu"
    assert time.monotonic() - start < 15
    # sent to a worker once: its CPU form, after the fallback (never its GPU form)
    assert [t[2] for t in s.story(future.key)].count("processing") == 1
    (fell,) = events(s, "fallback")
    assert fell["reason"] == "timeout"
    exact = accelsched.dual(on_gpu, on_cpu, memory=_half, fallback_timeout="60s")
    assert await c.submit(exact, 2, pure=False) == "gpu"


@gen_cluster(client=True, nthreads=GPU_WORKER * 2, Worker=Worker, timeout=60)
async def test_sharers_closing_together_log_no_traceback(c, s, a, b):
    """Two workers sharing a device close together, as a whole cluster does: the one left
    is asked to report its larger share unless the scheduler knows it closes, and a guard
    whose worker closes keeps its handler and says so (before: ``No handler
    accelsched_report found``, or ``ConnectionPool is closed``, with a traceback, at
    nearly every close)."""
    await _register(c, s, share_gpus=True)
    await wait_for(lambda: [_memory_at(s, w.address) for w in (a, b)] == [7782, 7782])
    with captured_logger("distributed.core", level=logging.INFO) as core:
        await asyncio.gather(a.close(), b.close())
        await wait_for(lambda: not s.workers)
        await asyncio.sleep(0.5)  # a report asked for as the first left
    assert "accelsched_report" not in core.getvalue(), core.getvalue()


def _memory_at(s, address: str) -> float:  # type: ignore[no-untyped-def]
    return s.workers[address].resources.get("GPU-memory", 0)
