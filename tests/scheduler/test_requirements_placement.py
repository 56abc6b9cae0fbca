"""Placement by what a task needs of its device, on a cluster of mixed simulated GPUs.

Two nanny workers, each on one simulated device of its own: an 80 GiB H100 (compute
capability 9.0) and a 40 GiB A100 (8.0), as NVML reports them through the real pynvml.
"""

from __future__ import annotations

import asyncio
import os
import time

import dask
import pytest
from distributed import Nanny
from distributed.utils_test import gen_cluster

import accelsched
from tests.utils import A100, H100, events, wait_for

pytestmark = pytest.mark.usefixtures("mixed_gpus")

GiB = 2**30
WORKERS = [
    ("127.0.0.1", 4, {"env": {"CUDA_VISIBLE_DEVICES": "0"}, "resources": {"GPU": 1}}),
    ("127.0.0.1", 4, {"env": {"CUDA_VISIBLE_DEVICES": "1"}, "resources": {"GPU": 1}}),
]


def where() -> tuple[str, int | None, float]:
    """The device this task holds (its NVML name, CUDA index), and when it ran."""
    from accelsched.devices import NVMLMonitor

    device = accelsched.current_device()
    names = {d.index: d.name for d in NVMLMonitor().devices()}
    return names.get(device, "none") if device is not None else "none", device, time.time()


@accelsched.gpu(memory="60GiB")
def large(_: int) -> tuple[str, int | None, float]:
    return where()


@accelsched.gpu(model="*A100*")
def on_a100(_: int) -> tuple[str, int | None, float]:
    return where()


@accelsched.gpu(capability="9.0")
def hopper(_: int) -> tuple[str, int | None, float]:
    return where()


@accelsched.gpu(memory="8GiB", model="*A100*")
def small(i: int) -> tuple[float, float, int]:
    """Holds its lease for a while: tasks that share the device overlap in time."""
    start = time.time()
    time.sleep(0.4)
    return start, time.time(), os.getpid()


@accelsched.gpu(memory="100GiB", fallback_timeout="500ms")
def too_large(x: int) -> str:
    return "gpu" if accelsched.current_device() is not None else "cpu"


def _register(c):  # type: ignore[no-untyped-def]
    return accelsched.register(c, check_interval="1h", fast_restart=False)


async def _verified(c, s) -> None:  # type: ignore[no-untyped-def]
    await _register(c)
    await wait_for(lambda: len(events(s, "gpu-verified")) == 2)


@gen_cluster(client=True, Worker=Nanny, nthreads=WORKERS, timeout=90)
async def test_tasks_run_only_on_devices_that_meet_their_requirement(c, s, a, b):
    await _verified(c, s)
    by_name = {a.worker_address: H100, b.worker_address: A100}
    for step, want in ((large, H100), (on_a100, A100), (hopper, H100)):
        futures = c.map(step, range(6), pure=False)
        results = await c.gather(futures)
        assert {name for name, _, _ in results} == {want}, step
        assert {d for _, d, _ in results} == {0}
        who = await c.who_has(futures)
        assert {by_name[w] for ws in who.values() for w in ws} == {want}, step
    # the annotation form, for dask.annotate users
    with dask.annotate(resources={"GPU": 1}, gpu={"model": "*H100*"}):
        annotated = c.map(lambda i: where()[0], range(4), pure=False)
    assert set(await c.gather(annotated)) == {H100}


@gen_cluster(client=True, Worker=Nanny, nthreads=WORKERS, timeout=90)
async def test_declared_tasks_share_a_device_while_they_fit(c, s, a, b):
    """Four 8 GiB tasks fit the A100's 38 GiB at once: they run side by side on it."""
    await _verified(c, s)
    spans = await c.gather(c.map(small, range(4), pure=False))
    starts, ends = [st for st, _, _ in spans], [en for _, en, _ in spans]
    assert max(starts) < min(ends), "the four did not overlap on the one device"
    assert len({pid for _, _, pid in spans}) == 1
    restrictions = s.tasks[next(iter(s.tasks))].resource_restrictions
    assert restrictions == {"GPU-memory": 8 * 1024}  # MiB, no whole GPU


@gen_cluster(client=True, Worker=Nanny, nthreads=WORKERS, timeout=90)
async def test_a_hostname_restriction_narrows_a_requirement_and_never_widens_it(c, s, a, b):
    """Both workers run on 127.0.0.1: a task asking for an A100 and that host runs on
    the A100's worker alone (distributed placed it on the union of its host and worker
    restrictions: the H100's worker too, which sent it back)."""
    await _verified(c, s)
    futures = c.map(on_a100, range(8), workers=["127.0.0.1"], pure=False)
    assert {name for name, _, _ in await c.gather(futures)} == {A100}
    for f in futures:
        story = s.story(f.key)
        assert not [m for m in story if "reschedule" in str(m)], story  # sent nowhere else
    elsewhere = c.map(on_a100, range(2), workers=["10.255.255.1"], pure=False)  # no such host
    await asyncio.sleep(1)
    assert {s.tasks[f.key].state for f in elsewhere} == {"no-worker"}
    # one no device meets falls back after its timeout, on that host still
    fell = c.map(too_large, range(2), workers=["127.0.0.1"], pure=False)
    assert await asyncio.wait_for(c.gather(fell), 15) == ["cpu", "cpu"]


@gen_cluster(client=True, Worker=Nanny, nthreads=WORKERS, timeout=90)
async def test_set_restrictions_meets_a_requirement_and_never_replaces_it(c, s, a, b):
    """A task asking for an A100 and the H100's worker waits (nowhere meets both); its
    restrictions set to both workers (the scheduler's ``set_restrictions``), it runs on
    the A100's. distributed alone replaced the requirement's restriction by the new one:
    the task went to the H100's worker, which sent it back."""
    await _verified(c, s)
    task = c.submit(on_a100, 0, workers=[a.worker_address], pure=False)
    await wait_for(lambda: task.key in s.tasks and s.tasks[task.key].state == "no-worker")
    await c.scheduler.set_restrictions(worker={task.key: [a.worker_address, b.worker_address]})
    name, _, _ = await asyncio.wait_for(task, 15)
    assert name == A100
    story = s.story(task.key)
    assert not [m for m in story if "reschedule" in str(m)], story


@gen_cluster(client=True, Worker=Nanny, nthreads=WORKERS, timeout=90)
async def test_a_requirement_no_device_meets_is_said_and_follows_the_timeout(c, s, a, b):
    await _verified(c, s)
    assert await c.gather(c.map(too_large, range(3), pure=False)) == ["cpu"] * 3
    (unmet,) = events(s, "unmet-requirement")
    assert unmet["requirement"] == "memory>=100GiB"
    assert unmet["declarable"] == 78 * 2**30  # the 80 GiB H100 less its 2 GiB reserve
    fell = events(s, "fallback")
    assert fell and all(e.get("reason") == "timeout" for e in fell)


@gen_cluster(client=True, Worker=Nanny, nthreads=WORKERS, timeout=90)
async def test_a_bad_requirement_annotation_errs_that_task_alone_naming_it(c, s, a, b):
    await _verified(c, s)
    with dask.annotate(resources={"GPU": 1}, gpu={"memroy": "1GiB"}):
        bad = c.submit(lambda: 1, pure=False)
    good = c.submit(on_a100, 1, pure=False)
    with pytest.raises(ValueError, match="unknown GPU requirement key.*'memroy'"):
        await bad
    assert (await good)[0] == A100


@accelsched.gpu(memory="1GiB", model="*A100*")
def greedy(i: int) -> object:
    from accelsched.testing import device_alloc

    return device_alloc(4 * GiB)  # a result of 4 GiB, on a device it declared 1 GiB of


@gen_cluster(client=True, Worker=Nanny, nthreads=WORKERS, timeout=90)
async def test_a_task_adding_more_than_it_declared_is_reported(c, s, a, b):
    await _verified(c, s)
    first = c.submit(greedy, 0, pure=False)  # creates the device's context: no base
    await first
    second = c.submit(greedy, 1, pure=False)  # measured: alone on its device
    await second
    # the first too, by its allocations' peak, where the device-wide growth had no base
    await wait_for(lambda: len(events(s, "over-declared")) == 2)
    reported = events(s, "over-declared")
    assert {e["key"] for e in reported} == {first.key, second.key}
    for event in reported:
        assert event["declared"] == GiB and event["measured"] >= 4 * GiB
        assert event["worker"] == b.worker_address and event["device"] == 0


# --- enforce_memory: a task held to the memory it declared, its neighbours untouched ----
#
# Three tasks declaring 12 GiB each are packed on the A100 (38 GiB they may declare). One
# of them takes 30 GiB at once and holds it; the two honest ones allocate their 12 GiB a
# moment later: 30 + 12 is past the device's 40 GiB.


def _packed(declared_by: str, enforce: bool | None, declared: int = 12):  # type: ignore[no-untyped-def]
    @accelsched.gpu(memory=f"{declared}GiB", model="*A100*", enforce=enforce)
    def step(nbytes: int) -> tuple[int, float]:
        from accelsched.testing import device_alloc

        if nbytes <= declared * GiB:
            time.sleep(0.3)  # the greedy one first
        buf = device_alloc(nbytes)
        time.sleep(1.0)  # held while the others run beside it
        return buf.nbytes, time.time()

    step.__name__ = step.__qualname__ = f"packed_{declared_by}_{declared}"
    return step


@pytest.mark.parametrize(
    "switched_on_by, declared, taken",
    [("guard", 12, 30), ("step", 12, 30), ("guard", 2, 10)],
    ids=["guard-tight", "step-tight", "guard-2GiB-takes-10GiB"],
)
@gen_cluster(client=True, Worker=Nanny, nthreads=WORKERS, timeout=90)
async def test_enforce_memory_fails_the_greedy_task_and_spares_its_neighbours(
    c, s, a, b, switched_on_by, declared, taken
):
    from accelsched import DeclaredMemoryExceeded

    by_guard = switched_on_by == "guard"
    await accelsched.register(c, check_interval="1h", fast_restart=False, enforce_memory=by_guard)
    await wait_for(lambda: len(events(s, "gpu-verified")) == 2)
    step = _packed(switched_on_by, None if by_guard else True, declared)
    greedy_task = c.submit(step, taken * GiB, pure=False)
    honest = c.map(step, [declared * GiB, declared * GiB], pure=False)
    with pytest.raises(DeclaredMemoryExceeded) as failed:
        await greedy_task
    said = str(failed.value)
    assert f"declared {declared}.00 GiB" in said and f"{taken}.00 GiB" in said, said
    assert failed.value.declared == declared * GiB and failed.value.attempted == taken * GiB
    assert [n for n, _ in await c.gather(honest)] == [declared * GiB, declared * GiB]
    assert events(s, "over-declared") == []  # refused: it never held more


@gen_cluster(client=True, Worker=Nanny, nthreads=WORKERS, timeout=90)
async def test_without_enforce_memory_the_greedy_task_takes_its_neighbours_room(c, s, a, b):
    """What enforcement prevents, and the report that remains without it: the packed
    task's peak, though it never ran alone on its device."""
    from accelsched.testing import OutOfDeviceMemory

    await _verified(c, s)
    step = _packed("unenforced", None)
    greedy_task = c.submit(step, 30 * GiB, pure=False)
    honest = c.map(step, [12 * GiB, 12 * GiB], pure=False)
    assert (await greedy_task)[0] == 30 * GiB
    outcomes = await asyncio.gather(*honest, return_exceptions=True)
    assert all(isinstance(o, OutOfDeviceMemory) for o in outcomes), outcomes
    await wait_for(lambda: events(s, "over-declared"))
    (event,) = events(s, "over-declared")
    assert event["key"] == greedy_task.key
    assert event["declared"] == 12 * GiB and event["measured"] == 30 * GiB


@accelsched.gpu(memory="10GiB", model="*H100*")
def holds(event_name: str) -> int:
    """Holds 10 GiB declared on the H100 until the test lets it go."""
    from distributed import Event

    Event(event_name).wait(30)
    return 1


@gen_cluster(client=True, Worker=Nanny, nthreads=WORKERS, timeout=90)
async def test_status_shows_each_devices_model_capability_and_declared_memory(c, s, a, b):
    from distributed import Event

    from accelsched.display import render

    await _verified(c, s)
    done = Event("let-go")
    held = c.submit(holds, "let-go", pure=False)
    observer = s.plugins["accelsched-placement"].status_history

    def declared() -> dict[str, int | None]:
        snap = observer.snapshot()
        return {d["name"]: d["declared"] for w in snap["workers"] for d in w["devices"]}

    # the next heartbeats say so, for both devices
    await wait_for(lambda: declared().get(H100) == 10 * GiB and declared().get(A100) is not None)
    snap = observer.snapshot()
    devices = {d["name"]: d for w in snap["workers"] for d in w["devices"]}
    assert devices[H100]["capability"] == "9.0" and devices[A100]["capability"] == "8.0"
    assert devices[A100]["declared"] == 0
    text = render(snap)
    assert "CC" in text and "DECLARED" in text and "10.00 GiB" in text
    await done.set()
    assert await held == 1


@gen_cluster(client=True, Worker=Nanny, nthreads=WORKERS, timeout=90)
async def test_accelsched_s_own_memory_resource_named_by_hand_errs_naming_it(c, s, a, b):
    """``GPU-memory`` is what a task takes once the scheduler read its declared memory:
    named by hand, with ``GPU`` or without, the task errs alone, naming it and what to
    write instead (before: without ``GPU`` it ran on no device and failed inside
    accelsched with an ``IndexError``; beside it, it waited for ever)."""
    await _verified(c, s)
    for resources in ({"GPU-memory": 1024}, {"GPU": 1, "GPU-memory": 1024}):
        bad = c.submit(lambda: 1, resources=resources, pure=False)
        with pytest.raises(ValueError, match=r"'GPU-memory': 1024\}: accelsched's own resource"):
            await bad
    assert (await c.submit(on_a100, 1, pure=False))[0] == A100


@gen_cluster(client=True, Worker=Nanny, nthreads=WORKERS[:1], timeout=90)
async def test_a_guard_alone_refuses_the_memory_resource_named_by_hand(c, s, a):
    """With no placement plugin to read it (the guard registered alone), a task naming
    ``GPU-memory`` without ``GPU`` reaches the worker: it errs there, naming the
    resource, rather than run bound to no device."""
    await c.register_plugin(accelsched.GuardPlugin(fast_restart=False))
    await wait_for(lambda: s.workers[a.worker_address].resources.get("GPU-memory", 0) > 1024)
    with pytest.raises(ValueError, match=r"'GPU-memory': \.\.\.\} without 'GPU'"):
        await c.submit(lambda: 1, resources={"GPU-memory": 1024}, pure=False)
