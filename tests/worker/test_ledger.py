"""Device memory accounted by measurement: results of types accelsched knows nothing
about (as cudf frames, torch tensors) are held, not leaked, where they are made and where
they move; a real leak beside them is caught, attributed to its step, and restarts only
its worker. Real nanny workers on fake GPUs."""

from __future__ import annotations

import asyncio
from typing import Any

import dask
import pytest
from distributed import Event, Nanny
from distributed.utils_test import gen_cluster

import accelsched
from accelsched.devices import knows
from accelsched.policy.leak import Attribution
from accelsched.testing import device_alloc
from tests.utils import (
    CONFIRMED,
    FAST,
    TWO_GPU_WORKERS,
    GiB,
    MiB,
    _guard_checks,
    cvd,
    events,
    gpus,
    guard_checks,
    inc,
    marked_warm_up,
    wait_for,
)

pytestmark = pytest.mark.usefixtures("fake_gpus_2")


class Frame:
    """Stands in for a cudf.DataFrame: device memory behind a type with no rule anywhere
    (no ``device_nbytes`` registration, no array protocol, not from a GPU library)."""

    def __init__(self, nbytes: int, value: int) -> None:
        self.payload = device_alloc(nbytes, value=value)  # moves (reallocated) with it

    @property
    def value(self) -> int:
        return self.payload.value


@accelsched.gpu
def make_frame(nbytes: int, value: int) -> Frame:
    return Frame(nbytes, value)


@accelsched.gpu
def leaky(i: int) -> int:
    device_alloc(512 * MiB, leak=True)
    return i


def test_an_unknown_type_is_not_known() -> None:
    assert not knows(object()) and not knows(Frame.__new__(Frame))
    assert knows(1) and knows("x") and knows([1, 2.0])
    np = pytest.importorskip("numpy")
    assert knows(np.zeros(3))


def test_attribution_ranks_by_bytes_per_device() -> None:
    a = Attribution()
    for prefix, n in [("load", 0), ("clean", 10), ("train", 500), ("clean", 20), ("x", -5)]:
        a.record(prefix, {0: n})
    a.record("other", {1: 900})
    ranked = {d: s.ranked for d, s in a.suspects([0, 1, 2], {}, clear=False).items()}
    assert ranked[0] == (("train", 500), ("clean", 30))
    assert ranked[1] == (("other", 900),) and ranked[2] == ()
    a.suspects([], {}, clear=True)
    assert a.suspects([0], {}, clear=False)[0].ranked == ()


def test_a_lease_proves_it_was_alone_for_the_whole_run() -> None:
    from accelsched.policy.requirements import LeaseTable

    t = LeaseTable([0, 1])
    t.grant("a", 0.5)
    token = t.alone_token("a")
    assert token is not None and t.still_alone("a", token)
    t.grant("b", 0.5)  # packs onto a's device
    assert t.alone_token("a") is None
    t.release("b")  # gone again: but it was there meanwhile
    assert not t.still_alone("a", token)
    assert t.still_alone("a", t.alone_token("a"))
    t.grant("c", 1)  # another device: a stays alone
    assert t.still_alone("a", t.alone_token("a"))


@gen_cluster(client=True, Worker=Nanny, nthreads=TWO_GPU_WORKERS, timeout=90)
async def test_opaque_results_are_held_where_made_and_where_moved(c, s, a, b):
    await accelsched.register(c, **FAST)
    A, B = a.worker_address, b.worker_address
    await wait_for(lambda: gpus(s, A) == 1 and gpus(s, B) == 1)
    await c.gather([c.submit(marked_warm_up, workers=[w], pure=False) for w in (A, B)])
    # a 1 GiB result of an unknown type, kept on A: measured when made, held, not leaked
    frame = c.submit(make_frame, 1024 * MiB, 7, workers=[A], key="frame")
    await frame
    await guard_checks(c, s, [A, B], CONFIRMED)
    assert not events(s, "leak"), (events(s), A, B)
    # it moves to B as data (a transfer): measured on arrival there, held, not leaked
    await c.replicate([frame], n=2)
    await wait_for(lambda: len(s.tasks["frame"].who_has or ()) == 2)
    await guard_checks(c, s, [A, B], CONFIRMED)
    assert not events(s, "leak") and not events(s, "restart")

    # a real leak beside it, on B: caught, named, and only B restarts
    await c.submit(leaky, 1, workers=[B], key="leaky-1")
    await wait_for(lambda: events(s, "restart"), timeout=30)
    (leak,) = events(s, "leak")
    assert leak["worker"] == B and list(leak["prefixes"]) == ["leaky"]
    assert leak["attributed"]["leaky"] >= 512 * MiB and leak["unexplained"] < 256 * MiB
    # the restart moved B's copies to A; memory following keys causes no cascade
    await wait_for(lambda: len(s.workers) == 2 and B not in s.workers)
    await guard_checks(c, s, list(s.workers), CONFIRMED)
    assert len(events(s, "leak")) == 1 and len(events(s, "restart")) == 1
    assert not events(s, "quarantine") and not events(s, "restart-deferred")
    assert (await frame).value == 7


def _holds(key: str, dask_worker: Any) -> bool:
    return key in dask_worker.data


def _value(frame: Frame) -> int:
    return frame.value


def _held_by(key: str, dask_worker: Any) -> int | None:
    """The device bytes the guard's ledger holds for ``key`` (None: not in memory)."""
    if key not in dask_worker.data:
        return None
    return sum(dask_worker.plugins["accelsched-guard"].ledger._held.get(key, {}).values())


@gen_cluster(client=True, Worker=Nanny, nthreads=TWO_GPU_WORKERS, timeout=90)
async def test_a_frame_moved_in_right_after_a_release_is_no_leak(c, s, a, b):
    """A worker lets go of a 1 GiB result and, before its next leak check, fetches for a
    task a peer's 1 GiB result of a type nobody described (as tensors of a library with
    no rule move in a shuffle): measured on arrival from a base read as the fetch
    started, held, no leak. Before, the release left no base to measure the arrival
    from, and its gigabyte was declared leaked. A round in which a check ran between the
    release and the arrival, or distributed's memory manager dropped A's copy at once,
    proves nothing: tried again, with the next pair of frames."""
    await accelsched.register(c, **{**FAST, "check_interval": "1s"})
    A, B = a.worker_address, b.worker_address
    await wait_for(lambda: gpus(s, A) == 1 and gpus(s, B) == 1)
    await c.gather([c.submit(marked_warm_up, workers=[w], pure=False) for w in (A, B)])
    for i in range(3):
        here = c.submit(make_frame, 1024 * MiB, 1, workers=[A], key=f"here-{i}")
        there = c.submit(make_frame, 1024 * MiB, 2, workers=[B], key=f"there-{i}")
        await c.gather([here, there])
        await guard_checks(c, s, [A, B], CONFIRMED)
        assert not events(s, "leak")
        checks = await c.run(_guard_checks, workers=[A])
        del here
        while (await c.run(_holds, f"here-{i}", workers=[A]))[A]:  # A let go of it
            await asyncio.sleep(0.01)
        # fetched by A for a task there, within a check interval of the release
        assert await c.submit(_value, there, workers=[A], pure=False) == 2
        held = (await c.run(_held_by, f"there-{i}", workers=[A]))[A]
        # (distributed's memory manager may have dropped A's copy already: no proof)
        if held is not None and await c.run(_guard_checks, workers=[A]) == checks:
            assert held >= 1024 * MiB  # measured on arrival (before: nothing)
            break
    else:
        pytest.fail("a leak check ran between the release and the arrival in every round")
    await guard_checks(c, s, [A, B], CONFIRMED)
    assert not events(s, "leak") and not events(s, "restart"), events(s)
    assert (await there).value == 2


@accelsched.gpu
def keep(i: int) -> int:
    """A GPU step that allocates nothing on its device."""
    return i


@gen_cluster(client=True, Worker=Nanny, nthreads=TWO_GPU_WORKERS[:1], timeout=90)
async def test_a_step_that_allocated_nothing_is_never_named(c, s, a):
    """``keep`` runs first and allocates nothing; ``leaky`` is the first to allocate on
    the device (it makes the process's context there), so no run can be measured and
    nothing explains the leak: the event names ``leaky`` alone, never ``keep``."""
    await accelsched.register(c, **FAST)
    A = a.worker_address
    await wait_for(lambda: gpus(s, A) == 1)
    assert await c.gather([c.submit(keep, i, workers=[A]) for i in range(3)]) == [0, 1, 2]
    await c.submit(leaky, 1, workers=[A], key="leaky-1")
    await wait_for(lambda: events(s, "leak"), timeout=30)
    (leak,) = events(s, "leak")
    assert list(leak["prefixes"]) == ["leaky"], leak
    assert leak["attributed"] == {}  # the leaking run made the context: not measured


@gen_cluster(client=True, Worker=Nanny, nthreads=TWO_GPU_WORKERS, timeout=90)
async def test_leak_inside_a_fused_task_is_named_by_its_step(c, s, a, b):
    """Five step types fused into one task per block; one leaks: it is named first."""
    da = pytest.importorskip("dask.array")
    await accelsched.register(c, **FAST)
    await wait_for(lambda: gpus(s, a.worker_address) == 1 and gpus(s, b.worker_address) == 1)
    x = da.ones((40, 10), chunks=(10, 10))
    steps = [step_load, step_clean, step_scale, step_leak, step_total]
    y = x
    for step in steps:
        y = y.map_blocks(step, dtype="f8")
    with dask.config.set({"optimization.fuse.active": None}):
        await c.compute(y.sum())
    await wait_for(lambda: events(s, "leak"), timeout=30)
    assert all(e["prefixes"][0] == "step_leak" for e in events(s, "leak"))


def _scratch(block):  # type: ignore[no-untyped-def]
    device_alloc(int(block.nbytes) * 1000)  # a temporary: back to the pool at once
    return block


@accelsched.gpu
def step_load(block):  # type: ignore[no-untyped-def]
    return _scratch(block)


@accelsched.gpu
def step_clean(block):  # type: ignore[no-untyped-def]
    return _scratch(block)


@accelsched.gpu
def step_scale(block):  # type: ignore[no-untyped-def]
    return _scratch(block) * 2


@accelsched.gpu
def step_leak(block):  # type: ignore[no-untyped-def]
    device_alloc(160 * MiB, leak=True)
    return _scratch(block)


@accelsched.gpu
def step_total(block):  # type: ignore[no-untyped-def]
    return _scratch(block) + 1


@accelsched.gpu
def kept_buffer(nbytes: int) -> Any:
    """A result of a known type holding ``nbytes`` on the task's device."""
    return device_alloc(nbytes, value=1)


@accelsched.gpu
def leaks_as_told(started: str, go: str) -> int:
    """Leaks 512 MiB, says so, and ends when told."""
    device_alloc(512 * MiB, leak=True)
    Event(started).set()
    Event(go).wait(30)
    return 1


@gen_cluster(client=True, Worker=Nanny, nthreads=TWO_GPU_WORKERS[:1], timeout=90)
async def test_a_result_released_while_a_task_leaks_neither_hides_nor_clears_it(c, s, a):
    """A 1 GiB result is released while a measured task that leaked 512 MiB runs: its
    closing reading is lower than its base, so its growth is not its own to tell. The
    run stays unmeasured and a suspect, and the leak event names it (before: its growth
    read as nothing, it was cleared as having left nothing, and the event named no
    prefix, or the result's maker when no clean check ran between)."""
    await accelsched.register(c, **FAST)
    A = a.worker_address
    await wait_for(lambda: gpus(s, A) == 1)
    await c.submit(marked_warm_up, workers=[A], pure=False)  # a context: runs are measured
    held = c.submit(kept_buffer, 1024 * MiB, workers=[A], key="held")
    await held
    await guard_checks(c, s, [A], CONFIRMED)  # clean: no suspect left from before
    assert not events(s, "leak")
    leaking = c.submit(leaks_as_told, "leaks-started", "leaks-go", workers=[A], key="leaks")
    await Event("leaks-started").wait(30)
    del held
    while (await c.run(_holds, "held", workers=[A]))[A]:  # A let go of it as the task ran
        await asyncio.sleep(0.01)
    await Event("leaks-go").set()
    assert await leaking == 1
    await wait_for(lambda: events(s, "leak"), timeout=30)
    leak = events(s, "leak")[0]
    assert list(leak["prefixes"]) == ["leaks"], leak  # (its key's prefix)


@accelsched.gpu(memory="2GiB")
def holds_as_told(started: str, go: str) -> Any:
    """Holds 1.5 GiB of the 2 GiB it declared, says so, and ends when told."""
    kept = device_alloc(1536 * MiB, value=2)
    Event(started).set()
    Event(go).wait(30)
    return kept


@gen_cluster(
    client=True,
    Worker=Nanny,
    nthreads=[("127.0.0.1", 2, cvd("0")), ("127.0.0.1", 1, cvd("1"))],
    timeout=90,
)
async def test_data_fetched_while_a_declared_task_runs_is_not_its_growth(c, s, a, b):
    """A peer's 1 GiB result lands on the device while a task that declared 2 GiB and
    holds 1.5 runs (fetched for a task in the worker's other thread): no
    ``over-declared`` (before: 2.5 GiB measured against its 2, the arrival counted as
    its own growth)."""
    await accelsched.register(c, **FAST)
    A, B = a.worker_address, b.worker_address
    await wait_for(lambda: gpus(s, A) == 1 and gpus(s, B) == 1)
    await c.gather([c.submit(marked_warm_up, workers=[w], pure=False) for w in (A, B)])
    there = c.submit(kept_buffer, 1024 * MiB, workers=[B], key="there")
    await there
    holding = c.submit(holds_as_told, "holds-started", "holds-go", workers=[A], key="holds")
    await Event("holds-started").wait(30)
    assert await c.submit(_value, there, workers=[A], pure=False) == 1  # fetched to A
    await Event("holds-go").set()
    assert (await holding).value == 2
    await guard_checks(c, s, [A], CONFIRMED)  # (events sent meanwhile have arrived)
    assert not events(s, "over-declared"), events(s)


def test_an_arrival_spoils_measured_runs_only_where_it_may_hold_memory() -> None:
    """Data from a peer that holds nothing (a number) moves nothing; one of a known type
    moves the devices it holds memory on; one of a type nobody described may be anywhere
    (before the fix's review: every arrival spoiled every measured run on every device,
    so a shuffle of plain data left a multi-GPU worker's long GPU tasks unmeasured)."""
    from accelsched.devices import NVMLMonitor
    from accelsched.worker.leak_check import Ledger

    memory: dict[str, object] = {}
    ledger = Ledger(NVMLMonitor(), stored=memory.get)
    before = {d: ledger.moves((d,)) for d in (0, 1)}
    memory["number"] = 7
    assert ledger.entered("number", computed=False) == {}
    assert {d: ledger.moves((d,)) for d in (0, 1)} == before
    memory["buffer"] = device_alloc(MiB, device=1)  # a known type on device 1
    ledger.entered("buffer", computed=False)
    assert ledger.moves((0,)) == before[0] and ledger.moves((1,)) != before[1]
    moved = {d: ledger.moves((d,)) for d in (0, 1)}
    memory["frame"] = _opaque(MiB)  # a type nobody described: it may be on either
    ledger.entered("frame", computed=False)
    assert all(ledger.moves((d,)) != moved[d] for d in (0, 1))


def test_a_release_during_a_tasks_closing_reading_leaves_no_stale_base() -> None:
    """A key released on the event loop while a GPU task's thread takes its closing
    reading: that reading must not become the next task's base (it still counts the
    released bytes, so the next task's growth would come out short by them). The real
    monitor on the fake GPUs; the release is run inside the reading to pin the order."""
    from accelsched.devices import MemoryReading, NVMLMonitor
    from accelsched.worker.leak_check import Ledger

    class Racing(NVMLMonitor):
        race: list = []

        def process_memory(self, device: int) -> MemoryReading:
            reading = super().process_memory(device)
            while self.race:
                self.race.pop()()
            return reading

    monitor = Racing()
    ledger = Ledger(monitor)
    released = [device_alloc(64 * MiB, device=0)]  # a result in memory
    moves = ledger.moves((0,))
    base, _, _ = ledger.take_base((0,), None)
    assert base is not None
    result = device_alloc(MiB, device=0)

    def release() -> None:  # the key released on the event loop, its bytes given back
        from accelsched.devices import active_pools

        released.clear()
        for pool in active_pools():
            pool.free_all()
        ledger.forget([0])

    monitor.race.append(release)
    assert ledger.after("k", base, result, moves) is None  # the release is no growth of its
    now = ledger.read(0)[0]
    assert now is not None and now <= base[0] + MiB - 64 * MiB
    assert ledger.take_base((0,), None)[0] == {0: now}


@accelsched.gpu
def frame_in_fixed_pool(nbytes: int, value: int) -> Frame:
    from accelsched.testing import fixed_pool

    fixed_pool(4096 * MiB)  # as --rmm-pool-size: reserved once, allocations come from it
    return Frame(nbytes, value)


def test_a_reserve_net_of_its_free_part() -> None:
    from accelsched.devices import PoolStats
    from accelsched.worker.leak_check import net_of_pools

    # a 4 GiB reserve with 1 GiB in use: that GiB counts, the free 3 GiB do not
    assert net_of_pools(5 * 2**30, PoolStats(fixed=4 * 2**30, fixed_free=3 * 2**30)) == 2**31
    # a reserve that cannot say what is free: all of it left out
    assert net_of_pools(5 * 2**30, PoolStats(fixed=4 * 2**30, fixed_free=None)) == 2**30


@gen_cluster(client=True, Worker=Nanny, nthreads=TWO_GPU_WORKERS, timeout=90)
async def test_opaque_results_inside_a_fixed_pool_are_held(c, s, a, b):
    """A cudf-like result allocated from an RMM-style pool shrinks the pool's free part,
    not NVML's figure: measured so, it is held, and no leak is declared."""
    await accelsched.register(c, **FAST)
    await wait_for(lambda: sum(gpus(s, w) for w in s.workers) == 2, 30)
    await c.submit(marked_warm_up, workers=[a.worker_address], pure=False)
    kept = [
        c.submit(frame_in_fixed_pool, 512 * MiB, i, workers=[a.worker_address], pure=False)
        for i in range(4)  # 2 GiB of results, eight times the threshold
    ]
    await c.gather(kept)
    await guard_checks(c, s, [a.worker_address, b.worker_address], CONFIRMED)
    assert not events(s, "leak")
    assert [await f for f in kept] and len(s.workers) == 2


class _Tensor:
    """Stands in for a torch tensor with no rule: a GPU library's type, sized by dask's
    ``sizeof`` (here its ``nbytes``)."""

    __module__ = "torch"

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.payload = device_alloc(nbytes, device=0)


def _opaque(nbytes: int) -> Frame:
    """A result of a type nobody described, as it lands on device 0 from a peer."""
    frame = Frame.__new__(Frame)
    frame.payload = device_alloc(nbytes, device=0)
    return frame


def test_data_from_a_peer_is_measured_at_its_own_size() -> None:
    """Results of a type nobody described arriving from a peer right after a release,
    before a leak check ran (a worker's copy dropped and fetched back, a shuffle): the
    release left no base to measure them from, so one is read as the fetch starts; they
    are measured at their own size, and a leak left before the fetch stays a leak. Before,
    the arrival was held at nothing and its bytes read as a leak, which restarted a
    healthy worker. The real monitor on the fake GPUs; ``fetching`` is what the guard
    calls as a key's fetch starts."""
    from accelsched.devices import MemoryReading, NVMLMonitor
    from accelsched.worker.leak_check import Ledger

    class Counting(NVMLMonitor):
        reads = 0

        def process_memory(self, device: int) -> MemoryReading:
            Counting.reads += 1
            return super().process_memory(device)

    memory: dict[str, object] = {}
    ledger = Ledger(Counting(), stored=memory.get, idle=lambda: {0})
    device_alloc(MiB, device=0)  # a context on device 0 (its bytes go to the cache)
    settled = ledger.read(0)[0]
    assert settled is not None
    ledger.settle(0, settled)  # a leak check found everything explained

    def arrives(key: str, nbytes: int) -> dict[int, int]:
        memory[key] = _opaque(nbytes)
        return ledger.entered(key, computed=False)

    def release(key: str) -> None:
        del memory[key]  # its bytes go back (to the pool's cache)
        assert ledger.released(key)

    memory["peer"] = device_alloc(512 * MiB, device=0)  # from a peer, of a known type
    assert ledger.entered("peer", computed=False) == {0: 512 * MiB}
    release("peer")
    ledger.fetching()
    assert arrives("a", GiB) == {0: GiB}
    # a leak, then a release: the base read as the next fetch starts counts the leak
    device_alloc(256 * MiB, device=0, leak=True)
    release("a")
    ledger.fetching()
    assert arrives("b", GiB) == {0: GiB}
    assert ledger.live(0) == GiB
    # a base kept (the last arrival's reading): a fetch reads nothing
    reads = Counting.reads
    ledger.fetching()
    assert Counting.reads == reads
    # keys of a GPU library's type landing together after a release: each held at what
    # dask's sizeof says, as before (a base read as the fetch started would give the
    # first to enter the bytes of both)
    release("b")
    ledger.fetching()
    for key in ("t1", "t2"):
        memory[key] = _Tensor(512 * MiB)
    assert [ledger.entered(k, computed=False) for k in ("t1", "t2")] == [{0: 512 * MiB}] * 2


def test_a_fetch_reads_a_device_with_no_figure_once_per_check() -> None:
    """A device where a reading gives no figure (no context of this process there) is
    not read again at every key's fetch, only after the next leak check."""
    from accelsched.devices import MemoryReading, NVMLMonitor
    from accelsched.worker.leak_check import Ledger

    class Counting(NVMLMonitor):
        reads: list[int] = []

        def process_memory(self, device: int) -> MemoryReading:
            Counting.reads.append(device)
            return super().process_memory(device)

    ledger = Ledger(Counting(), idle=lambda: {1})  # nothing ever ran on device 1
    for _ in range(3):
        ledger.fetching()
    assert Counting.reads == [1]
    ledger.recheck()  # as every leak check does
    ledger.fetching()
    assert Counting.reads == [1, 1]


def make_gigabyte() -> object:
    return device_alloc(GiB, device=0)


def passthrough(value: object) -> object:
    """An identity step (a select, a getitem that returns its input): its result is the
    same object as its input's."""
    return value


def _live(dask_worker: Any) -> int:
    return dask_worker.plugins["accelsched-guard"].ledger.live(0)


@gen_cluster(client=True, Worker=Nanny, nthreads=[("127.0.0.1", 1, cvd("0"))], timeout=90)
async def test_a_result_that_is_another_results_allocation_is_live_once(c, s, a, fake_gpus_2):
    """A CPU task returning its input, a 1 GiB device buffer a measured GPU task made:
    two keys, one allocation, live once; both released, no leak, with a 512 MiB context
    over a 256 MiB threshold
    (before: live twice, which lowered the baseline below the context, and once both were
    released the context was declared leaked, naming no prefix, and the idle worker was
    restarted)."""
    fake_gpus_2.set_flags(context_memory="512MiB")  # (its pool reads it at its first alloc)
    await accelsched.register(c, **FAST)
    A = a.worker_address
    await wait_for(lambda: gpus(s, A) == 1)
    await c.submit(marked_warm_up, pure=False)  # the context: the buffer's run is measured
    with dask.annotate(resources={"GPU": 1}):
        buffer = c.submit(make_gigabyte, key="buffer")
    same = c.submit(passthrough, buffer, key="same")
    await c.gather([buffer, same])
    assert (await c.run(_live, workers=[A]))[A] == GiB
    await guard_checks(c, s, [A], CONFIRMED)
    del buffer
    while (await c.run(_holds, "buffer", workers=[A]))[A]:  # the worker let go of it
        await asyncio.sleep(0.01)
    assert (await c.run(_live, workers=[A]))[A] == GiB  # the other key holds it still
    del same
    while (await c.run(_holds, "same", workers=[A]))[A]:
        await asyncio.sleep(0.01)
    await guard_checks(c, s, [A], CONFIRMED)
    assert (await c.run(_live, workers=[A]))[A] == 0
    assert not events(s, "leak") and not events(s, "restart")


def test_an_allocation_is_live_once_whatever_holds_it_and_however_often() -> None:
    """Keys sharing one object, a key entered again, a base that holds no device memory:
    live is what is on the device (the ledger alone, its values in a dict)."""
    from accelsched.devices import NVMLMonitor
    from accelsched.worker.leak_check import Ledger

    memory: dict[str, Any] = {}
    ledger = Ledger(NVMLMonitor(), stored=memory.get)
    buffer = memory["a"] = memory["b"] = device_alloc(MiB, device=0)
    for key in ("a", "b", "b"):  # "b" entered twice (what it held first goes)
        ledger.entered(key, computed=True)
    assert ledger.live(0) == MiB
    assert ledger.released("a") is False and ledger.live(0) == MiB  # "b" holds it
    assert ledger.released("b") is True and ledger.live(0) == 0

    from accelsched.devices import device_nbytes

    class Handled:
        """A device type whose ``base`` is a handle every value shares, no allocation."""

        base = object()

        def __init__(self) -> None:
            self.payload = device_alloc(MiB, device=0)

    device_nbytes.register(Handled)(lambda frame: {0: MiB})
    for i in range(2):
        memory[f"h{i}"] = Handled()
        ledger.entered(f"h{i}", computed=True)
    assert ledger.live(0) == 2 * MiB  # two allocations, not one
    del buffer


def make_buffer(i: int) -> object:
    return device_alloc(GiB, device=0)


def _spilled(dask_worker: Any) -> int:
    return len(dask_worker.data.slow)


def _size(buffer: Any) -> int:
    return int(buffer.nbytes)


def _live_and_resident(dask_worker: Any) -> tuple[int, int]:
    ledger = dask_worker.plugins["accelsched-guard"].ledger
    return ledger.live(0), ledger.resident(0)


@gen_cluster(
    client=True,
    Worker=Nanny,
    nthreads=[("127.0.0.1", 1, cvd("0"))],
    worker_kwargs={"memory_limit": "2GiB"},
    timeout=90,
)
async def test_device_results_spilled_while_a_check_runs_leave_the_context_in_the_baseline(
    c, s, a, fake_gpus_2
):
    """Three 1 GiB device results on a worker whose memory limit is 2 GiB: distributed
    spills some to disk, which gives their device memory back; checks run while they are
    spilled, and while they are read back for tasks; all released, no leak, with a 512 MiB
    context over a 256 MiB threshold (before: spilled results still counted on the
    device lowered the baseline below the context, and once they were released the
    context was declared leaked and the worker restarted)."""
    fake_gpus_2.set_flags(context_memory="512MiB")
    await accelsched.register(c, **FAST)
    A = a.worker_address
    await wait_for(lambda: gpus(s, A) == 1)
    with dask.annotate(resources={"GPU": 1}):
        buffers = c.map(make_buffer, range(3), key=[f"buffer-{i}" for i in range(3)])
    await c.gather(buffers)
    while (await c.run(_spilled, workers=[A]))[A] < 1:
        await asyncio.sleep(0.05)
    # a GPU task: the guard frees the pool's cache after it, so the memory of the
    # buffers spilled goes back to the device, as CuPy's pool gives it back
    with dask.annotate(resources={"GPU": 1}):
        assert await c.submit(inc, 1, workers=[A], pure=False) == 2
    live_and_resident = (await c.run(_live_and_resident, workers=[A]))[A]
    assert live_and_resident[0] == 3 * GiB and live_and_resident[1] < 3 * GiB
    await guard_checks(c, s, [A], CONFIRMED)  # while spilled
    # each read back for a task on the worker (another spilled in its place)
    sizes = c.map(_size, buffers, workers=[A], key=[f"size-{i}" for i in range(3)])
    assert await c.gather(sizes) == [GiB] * 3
    await guard_checks(c, s, [A], CONFIRMED)
    assert (await c.run(_live, workers=[A]))[A] == 3 * GiB  # spilled or not: still live
    assert not events(s, "leak")
    del buffers, sizes
    while (await c.run(lambda dask_worker: len(dask_worker.data), workers=[A]))[A]:
        await asyncio.sleep(0.01)
    await guard_checks(c, s, [A], CONFIRMED)
    assert not events(s, "leak") and not events(s, "restart")
    assert (await c.run(_live, workers=[A]))[A] == 0


def test_resident_is_live_less_what_left_memory() -> None:
    """What results hold on a device now: a key out of memory (spilled) holds nothing
    there; an allocation two keys share is there while either is in memory; without a
    way to tell, all that is live (the ledger alone, its values in a dict)."""
    from accelsched.devices import NVMLMonitor
    from accelsched.worker.leak_check import Ledger

    memory: dict[str, Any] = {}
    out: set[str] = set()
    from accelsched.internals.worker import Residence

    where = Residence(lambda key: key not in out, lambda: bool(out))
    ledger = Ledger(NVMLMonitor(), stored=memory.get, in_memory=where)
    memory["one"] = device_alloc(MiB, device=0)
    memory["two"] = device_alloc(2 * MiB, device=0)
    memory["a"] = memory["b"] = device_alloc(4 * MiB, device=0)
    for key in ("one", "two", "a", "b"):
        ledger.entered(key, computed=True)
    assert ledger.live(0) == ledger.resident(0) == 7 * MiB
    out.update({"two", "a"})
    assert (ledger.live(0), ledger.resident(0)) == (7 * MiB, 5 * MiB)  # "b" holds it
    out.add("b")
    assert (ledger.live(0), ledger.resident(0)) == (7 * MiB, MiB)
    assert ledger.resident(1) == 0
    unknowing = Ledger(NVMLMonitor(), stored=memory.get)
    unknowing.entered("two", computed=True)
    assert unknowing.resident(0) == 2 * MiB
