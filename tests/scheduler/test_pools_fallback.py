"""Fallback that knows the pools: a GPU task's timeout counts from when no worker that
could serve it is coming (``accelsched_pools``, what ``accelsched.adapt`` says), and a
task whose pools are at their maximum falls back as before, its event naming them."""

from __future__ import annotations

import asyncio
import time

import dask
from distributed.core import Status
from distributed.utils_test import gen_cluster

import accelsched
from accelsched.protocol import DEMAND_HANDLER, PLACEMENT_PLUGIN, POOLS_HANDLER
from tests.utils import events, inc, wait_for

CPU_WORKER = [("127.0.0.1", 1)]


@gen_cluster(client=True, nthreads=CPU_WORKER)
async def test_a_starting_worker_holds_the_fallback_within_the_bound(c, s, a):
    await accelsched.register(c)
    with dask.annotate(resources={"GPU": 1}, fallback_timeout="500ms"):
        fut = c.submit(inc, 1, key="x")
    await wait_for(lambda: s.tasks.get("x") is not None and s.tasks["x"].state == "no-worker")
    demand = await getattr(c.scheduler, DEMAND_HANDLER)()
    (cls,) = demand["gpu"]
    assert (cls["name"], cls["devices"], cls["waiting"], cls["running"]) == ("1x any", 1, 1, 0)
    assert demand["cpu_tasks"] == 0 and len(demand["workers"]) == 1
    t0 = time.monotonic()
    # a worker for "1x any" is said to be starting, for 1.5 s more: the timeout counts after
    reply = await getattr(c.scheduler, POOLS_HANDLER)(coming={"1x any": 1.5}, full={}, bound=10)
    assert reply == {"status": "OK"}
    assert await fut == 2  # it never came: the CPU form ran
    waited = time.monotonic() - t0
    (e,) = events(s, "fallback")
    assert e["reason"] == "timeout" and "pools_at_maximum" not in e
    assert 1.5 + 0.5 <= waited < 1.5 + 0.5 + 2, waited


@gen_cluster(client=True, nthreads=CPU_WORKER)
async def test_the_bound_caps_what_a_starting_worker_holds_back(c, s, a):
    await accelsched.register(c)
    with dask.annotate(resources={"GPU": 1}, fallback_timeout="300ms"):
        fut = c.submit(inc, 1, key="x")
    await wait_for(lambda: s.tasks.get("x") is not None and s.tasks["x"].state == "no-worker")
    t0 = time.monotonic()
    await getattr(c.scheduler, POOLS_HANDLER)(coming={"1x any": 600}, full={}, bound=0.5)
    assert await fut == 2
    assert time.monotonic() - t0 < 0.5 + 0.3 + 2  # not 600 s


@gen_cluster(client=True, nthreads=CPU_WORKER)
async def test_at_the_pools_maximum_the_task_falls_back_after_its_timeout(c, s, a):
    await accelsched.register(c)
    await getattr(c.scheduler, POOLS_HANDLER)(coming={}, full={"1x any": ["gpu"]}, bound=60)
    t0 = time.monotonic()
    with dask.annotate(resources={"GPU": 1}, fallback_timeout="300ms"):
        assert await c.submit(inc, 1, key="x") == 2
    assert time.monotonic() - t0 < 0.3 + 2
    (e,) = events(s, "fallback")
    assert e["reason"] == "timeout" and list(e["pools_at_maximum"]) == ["gpu"]


@gen_cluster(client=True, nthreads=CPU_WORKER)
async def test_a_bad_pools_request_changes_nothing(c, s, a):
    await accelsched.register(c)
    pools = getattr(c.scheduler, POOLS_HANDLER)
    for bad in (
        {"coming": {"1x any": "soon"}},
        {"coming": {"1x any": float("nan")}},
        {"bound": -1},
        {"coming": {"1x any": True}},
        {"full": {"1x any": "gpu"}},  # no list of pools (it read as the pools g, p, u)
        {"pools": "gpu"},  # the same for the pools' names
    ):
        assert await pools(**bad) == {"status": "invalid"}, bad
    with dask.annotate(resources={"GPU": 1}, fallback_timeout="300ms"):
        assert await c.submit(inc, 1, key="x") == 2
    (e,) = events(s, "fallback")
    assert e["waited"] < 2


@gen_cluster(client=True, nthreads=CPU_WORKER)
async def test_a_worker_is_in_the_pool_its_name_says(c, s, a):
    """The pools' names come with ``accelsched_pools``: worker ``<pool>-<n>`` is in
    ``pool``, any other name (another pool's, a suffix that is no number) in none."""
    await accelsched.register(c)
    demand = s.plugins[PLACEMENT_PLUGIN].fallback
    assert demand.pool_of("gpu-0") is None  # no pool said yet
    pools = getattr(c.scheduler, POOLS_HANDLER)
    assert await pools(coming={}, full={}, bound=1, pools=["gpu", "big.gpu"]) == {"status": "OK"}
    assert [demand.pool_of(n) for n in ("gpu-0", "gpu-12", "big.gpu-3")] == [
        "gpu",
        "gpu",
        "big.gpu",
    ]
    assert [demand.pool_of(n) for n in ("cpu-0", "gpu-x", "gpu", "gpu-", "0")] == [None] * 5
    # a request without names (an earlier accelsched.adapt) leaves them as they were
    assert await pools(coming={}, full={}, bound=1) == {"status": "OK"}
    assert demand.pool_of("gpu-1") == "gpu"


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_the_pools_see_a_retired_worker_but_not_one_accelsched_drains_to_restart(c, s, a, b):
    """A worker retired as a pool retires (closing gracefully, left registered) is said
    to retire, holding its result; one accelsched drains for a restart (closing
    gracefully too) is not: it comes back, and the pools must not close it meanwhile
    (before: both said retiring, so a look between its drain and its restart closed it)."""
    await accelsched.register(c)
    held = c.submit(inc, 1, workers=[a.address], pure=False)
    await held

    async def flags() -> dict[str, tuple[bool, bool, bool]]:
        reply = await getattr(c.scheduler, DEMAND_HANDLER)()
        return {w["address"]: (w["retiring"], w["running"], w["holds"]) for w in reply["workers"]}

    assert await flags() == {a.address: (False, True, True), b.address: (False, True, False)}
    retired = await c.retire_workers([a.address], close_workers=False, remove=False)
    assert list(retired) == [a.address]  # its result went to b first
    assert (await flags())[a.address] == (True, False, True)  # a copy stays till it closes
    assert (await flags())[b.address] == (False, True, True) and await held == 2
    budget = s.plugins[PLACEMENT_PLUGIN].budget
    assert budget.request(b.address, time.monotonic()) is None  # a restart of b in flight
    s.handle_worker_status_change(Status.closing_gracefully, s.workers[b.address], "drain")
    assert (await flags())[b.address] == (False, False, True)
    budget.done(b.address, counted=False)
    assert (await flags())[b.address] == (True, False, True)


@gen_cluster(client=True, nthreads=CPU_WORKER)
async def test_a_promise_holds_a_timeout_longer_than_twice_the_bound(c, s, a):
    """A worker said to be starting for 1 s (bound 1 s) holds back a 3 s timeout by that
    second, though the task's plain deadline comes after the promise and its bound have
    passed (before: forgotten by then, and the CPU form ran at 3 s)."""
    await accelsched.register(c)
    with dask.annotate(resources={"GPU": 1}, fallback_timeout="3s"):
        fut = c.submit(inc, 1, key="x")
    await wait_for(lambda: s.tasks.get("x") is not None and s.tasks["x"].state == "no-worker")
    t0 = time.monotonic()
    await getattr(c.scheduler, POOLS_HANDLER)(coming={"1x any": 1.0}, full={}, bound=1.0)
    await asyncio.sleep(2.2)  # the pools say again, as they do every interval: none coming
    await getattr(c.scheduler, POOLS_HANDLER)(coming={}, full={}, bound=1.0)
    assert await fut == 2
    waited = time.monotonic() - t0
    assert 1.0 + 3.0 - 0.3 <= waited < 1.0 + 3.0 + 2, waited
