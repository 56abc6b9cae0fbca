"""Reclaim before restart: a suspected leak that garbage collection gives back ends there.

Device memory that nothing reachable holds but a reference cycle does (an object that
points to itself, a failed task's traceback, whose frames hold the task's locals) comes
back with ``gc.collect()`` and a pool free: the guard tries that first and restarts the
worker only if the memory is still held. Real nanny processes on fake GPUs.
"""

from __future__ import annotations

import contextlib

import dask
import pytest
from distributed import Nanny
from distributed.utils_test import gen_cluster

import accelsched
from accelsched.display import render
from accelsched.testing import device_alloc
from tests.utils import (
    FAST,
    TWO_GPU_WORKERS,
    MiB,
    events,
    gpus,
    guard_checks,
    leaky,
    status_snapshot,
    wait_for,
)

pytestmark = pytest.mark.usefixtures("fake_gpus_2")


class Node:
    """Holds device memory and, through ``self.me``, itself: freed only by the GC."""

    def __init__(self, nbytes: int) -> None:
        self.buffer = device_alloc(nbytes)
        self.me = self


def cycle_leak(i: int) -> int:
    import gc

    node = Node(512 * MiB)
    gc.collect()  # it survives a collection: old, as a long-lived object is (a cache's
    del node  # entry, say), collected again only by a full collection, rarely
    return i


def failing(i: int) -> int:
    held = device_alloc(512 * MiB)  # noqa: F841 (a local of the frame the traceback keeps)
    raise ValueError(f"task {i} failed holding device memory")


async def ready(s) -> None:  # type: ignore[no-untyped-def]
    await wait_for(lambda: len(s.workers) == 2 and all(gpus(s, w) == 1 for w in s.workers))


async def _reclaimed_not_restarted(c, s, a, b, fn) -> dict:  # type: ignore[no-untyped-def]
    await accelsched.register(c, **FAST)
    await ready(s)
    target = a.worker_address
    with dask.annotate(resources={"GPU": 1}):
        future = c.submit(fn, 1, key="suspect-1", workers=[target])
        with contextlib.suppress(ValueError):  # the failing task
            await future
    await wait_for(lambda: events(s, "leak-reclaimed") or events(s, "leak"), timeout=30)
    assert not events(s, "leak"), str(events(s, "leak"))  # before reclaiming: a leak, a restart
    (ev,) = events(s, "leak-reclaimed")
    assert ev["worker"] == target and ev["reclaimed"] >= 512 * MiB
    assert ev["remaining"] <= ev["threshold"] and "prefixes" in ev
    # checks go on: no leak event, no restart, the same process
    await guard_checks(c, s, [target], 3)
    assert not events(s, "leak") and not events(s, "restart")
    assert a.worker_address == target
    # what ``accelsched status`` shows: one reclaimed leak on that worker, no leak
    snap = status_snapshot(s)
    (row,) = [w for w in snap["workers"] if w["address"] == target]
    assert [row[k] for k in ("reclaims", "leaks", "restarts")] == [1, 0, 0]
    assert (snap["reclaims"], snap["leaks"]) == (1, 0)
    assert "0 leaks, 1 reclaimed" in render(snap).splitlines()[0]
    return ev


@gen_cluster(client=True, Worker=Nanny, nthreads=TWO_GPU_WORKERS, timeout=60)
async def test_cycle_leak_is_reclaimed_without_restart(c, s, a, b):
    await _reclaimed_not_restarted(c, s, a, b, cycle_leak)


@gen_cluster(client=True, Worker=Nanny, nthreads=TWO_GPU_WORKERS, timeout=60)
async def test_failed_task_traceback_memory_is_reclaimed_without_restart(c, s, a, b):
    await _reclaimed_not_restarted(c, s, a, b, failing)


@gen_cluster(client=True, Worker=Nanny, nthreads=TWO_GPU_WORKERS, timeout=60)
async def test_real_leak_is_still_restarted(c, s, a, b):
    await accelsched.register(c, **FAST)
    await ready(s)
    target = a.worker_address
    with dask.annotate(resources={"GPU": 1}):
        await c.submit(leaky, 1, key="leaky-1", workers=[target])
    await wait_for(lambda: events(s, "restart"), timeout=30)
    (leak,) = events(s, "leak")
    assert leak["worker"] == target and leak["nbytes"] >= 512 * MiB
    assert leak["reclaimed"] == 0  # tried, nothing came back
    assert not events(s, "leak-reclaimed")
