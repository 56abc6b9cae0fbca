"""Device-memory guards with real nanny processes on fake GPUs.

A leak here is simulated device memory (``device_alloc(..., leak=True)``) that the fake
NVML reports for the worker's pid until the process exits, exactly as the driver reports
a CuPy array nobody frees.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

import dask
import pytest
from distributed import Nanny, Worker
from distributed.core import Status, rpc
from distributed.utils_test import captured_logger, gen_cluster

import accelsched
from accelsched.events import TOPIC
from accelsched.testing import device_alloc, fixed_pool
from tests.utils import (
    CONFIRMED,
    FAST,
    GPU_WORKER,
    TWO_GPU_WORKERS,
    GiB,
    MiB,
    background,
    computed_once,
    cvd,
    device_result,
    events,
    gpus,
    guard_checks,
    leaky,
    settled,
    verified,
    wait_for,
)

pytestmark = pytest.mark.usefixtures("fake_gpus_2")


def cached_on_device_0() -> int:
    """Bytes the simulated pool of this worker process caches on CUDA device 0."""
    from accelsched.devices import POOLS
    from accelsched.testing import SimulatedPool

    (pool,) = [p for p in POOLS if isinstance(p, SimulatedPool)]
    return pool.stats(0).cached


async def leak_on_only_worker(c, s, a, value: int):  # type: ignore[no-untyped-def]
    """Keep a result on the only worker, leak there, wait for the deferral; the result."""
    await accelsched.register(c, **FAST)
    await verified(s, a)
    with dask.annotate(resources={"GPU": 1}):
        kept = c.submit(device_result, value, key="kept")
        await kept
        await c.submit(leaky, 1, key="leaky-1")
    await wait_for(lambda: events(s, "restart-deferred"))
    return kept


@gen_cluster(client=True, Worker=Nanny, nthreads=TWO_GPU_WORKERS, timeout=60)
async def test_leak_restarts_only_that_worker_and_loses_nothing(c, s, a, b):
    await accelsched.register(c, **FAST)
    await verified(s, a, b)
    target = a.worker_address
    scattered = await c.scatter({"scattered": list(range(100))}, workers=[target])
    with dask.annotate(resources={"GPU": 1}):
        kept = [c.submit(device_result, i, key=f"result-{i}", workers=[target]) for i in range(3)]
    await c.gather(kept)
    assert all(s.tasks[f"result-{i}"].who_has == {s.workers[target]} for i in range(3))
    b_before = b.worker_address

    with dask.annotate(resources={"GPU": 1}):
        await c.submit(leaky, 1, key="leaky-1", workers=[target])
    await wait_for(lambda: events(s, "restart"), timeout=30)
    (leak,) = events(s, "leak")
    assert leak["worker"] == target and leak["nbytes"] >= 512 * MiB and "leaky" in leak["prefixes"]
    (restart,) = events(s, "restart")
    assert restart["worker"] == target and restart["moved"] >= 4
    # the restarted worker comes back, verified; its peer was never touched
    await wait_for(
        lambda: len(s.workers) == 2 and all(gpus(s, w) == 1 for w in s.workers), timeout=30
    )
    assert b.worker_address == b_before
    # every result and the scattered data survived, nothing was recomputed
    assert [r.value for r in await c.gather(kept)] == [0, 1, 2]
    assert await scattered["scattered"] == list(range(100))
    for i in range(3):
        assert computed_once(s, f"result-{i}")
        assert s.tasks[f"result-{i}"].suspicious == 0
    # the restarted worker and its peer check on: no second leak, no second restart
    await guard_checks(c, s, list(s.workers), CONFIRMED)
    assert len(events(s, "leak")) == 1 and len(events(s, "restart")) == 1  # exactly one


@gen_cluster(client=True, Worker=Nanny, nthreads=TWO_GPU_WORKERS, timeout=60)
async def test_no_false_positive_on_benign_workloads(c, s, a, b):
    await accelsched.register(c, free_pools_every=0, **FAST)
    await verified(s, a, b)

    def big_result(i: int) -> object:
        return device_alloc(GiB, value=i)  # held in worker memory: live, not leaked

    def cached_temporaries(i: int) -> int:
        for _ in range(3):
            device_alloc(GiB)  # freed at once: stays in the pool's cache (no freeing)
        return i

    def rmm_style(i: int) -> int:
        fixed_pool(4 * GiB)
        buf = device_alloc(GiB)
        return buf.nbytes

    with dask.annotate(resources={"GPU": 1}):
        held = c.map(big_result, range(4))
        await c.gather(held)
        await c.gather(c.map(cached_temporaries, range(4)))
        await c.gather(c.map(rmm_style, range(2)))
    await guard_checks(c, s, [a.worker_address, b.worker_address], CONFIRMED)
    assert not events(s, "leak")
    checked = await c.run(
        lambda dask_worker: len(dask_worker.plugins["accelsched-guard"].leaks.last_verdicts)
    )
    assert all(n >= 1 for n in checked.values())  # the checks did run
    del held


@gen_cluster(client=True, Worker=Nanny, nthreads=[("127.0.0.1", 1, cvd("0"))], timeout=60)
async def test_single_worker_is_quarantined_until_it_holds_nothing(c, s, a):
    """No peer to take its result: quarantined, not restarted. Once it holds and runs
    nothing, the next confirmed leak restarts it (nothing to lose), and its GPU is back
    (before: quarantined for as long as it stayed alone)."""
    kept = await leak_on_only_worker(c, s, a, 7)
    (deferred,) = events(s, "restart-deferred")
    assert deferred["reason"] == "no-peer"
    await wait_for(lambda: events(s, "quarantine"))
    # in the log, the leak comes before what the scheduler did about it
    said = [e["action"] for _, e in s.get_events(TOPIC)]
    assert said.index("leak") < said.index("restart-deferred") < said.index("quarantine"), said
    assert gpus(s, a.worker_address) == 0
    assert (await kept).value == 7
    assert not events(s, "restart")
    # GPU tasks now wait (or fall back) instead of landing on the leaking worker
    with dask.annotate(resources={"GPU": 1}, fallback_timeout=0):
        assert await c.submit(accelsched.current_device, key="elsewhere") is None
    old = a.worker_address
    del kept
    await wait_for(lambda: events(s, "restart"), timeout=30)
    (restart,) = events(s, "restart")
    assert restart["worker"] == old and restart["moved"] == 0  # nothing to move, none lost
    await wait_for(lambda: old not in s.workers and len(s.workers) == 1, timeout=30)
    await verified(s, a, count=1)
    with dask.annotate(resources={"GPU": 1}):
        assert await c.submit(accelsched.current_device, key="back") == 0


@gen_cluster(client=True, Worker=Nanny, nthreads=TWO_GPU_WORKERS, timeout=60)
async def test_restart_budget_stops_a_storm(c, s, a, b):
    await accelsched.register(c, max_restarts=1, restart_window="1h", **FAST)
    await verified(s, a, b)
    target = a.worker_address
    with dask.annotate(resources={"GPU": 1}):
        await c.submit(leaky, 1, key="leaky-1", workers=[target])
    await wait_for(lambda: events(s, "restart"), timeout=30)
    await wait_for(
        lambda: len(s.workers) == 2 and all(gpus(s, w) == 1 for w in s.workers), timeout=30
    )
    (new,) = set(s.workers) - {b.worker_address}
    with dask.annotate(resources={"GPU": 1}):
        await c.submit(leaky, 2, key="leaky-2", workers=[new])
    await wait_for(
        lambda: any(e.get("reason") == "restart-budget" for e in events(s, "quarantine"))
    )
    assert len(events(s, "restart")) == 1
    assert gpus(s, new) == 0


@gen_cluster(client=True, Worker=Nanny, nthreads=TWO_GPU_WORKERS, timeout=60)
async def test_a_restart_request_naming_another_worker_restarts_nobody(c, s, a, b):
    """A request naming a's address from b's process (or from a process a never was)
    is misdirected: refused as not from the process registered there."""
    await accelsched.register(c, **FAST)
    await verified(s, a, b)
    before = background(s)
    async with rpc(s.address) as r:
        for process in ("guess", s.workers[b.worker_address].server_id):
            reply = await r.accelsched_restart(
                worker=a.worker_address, process=process, request="1"
            )
            assert reply["status"] == "refused"
    await settled(s, before)  # a restart the requests started anyway would be over
    assert not events(s, "restart") and len(s.workers) == 2
    refused = events(s, "request-refused")
    assert [(e["worker"], e["handler"], e["reason"]) for e in refused] == [
        (a.worker_address, "accelsched_restart", "stale")
    ] * 2


@gen_cluster(client=True, Worker=Nanny, nthreads=[("127.0.0.1", 1, cvd("0"))], timeout=60)
async def test_pools_freed_after_gpu_tasks(c, s, a):
    await accelsched.register(c)
    await verified(s, a)

    def temporaries() -> None:
        device_alloc(GiB)

    with dask.annotate(resources={"GPU": 1}):
        await c.submit(temporaries, key="t")

    assert await c.run(cached_on_device_0) == {a.worker_address: 0}


@gen_cluster(client=True, Worker=Nanny, nthreads=[("127.0.0.1", 1, cvd("0"))], timeout=60)
async def test_pools_kept_when_freeing_is_off(c, s, a):
    await accelsched.register(c, free_pools_every=0)
    await verified(s, a)

    with dask.annotate(resources={"GPU": 1}):
        await c.submit(lambda: device_alloc(GiB).nbytes, key="t")

    assert await c.run(cached_on_device_0) == {a.worker_address: GiB}


@gen_cluster(client=True, Worker=Nanny, nthreads=[("127.0.0.1", 1, cvd("0"))], timeout=60)
async def test_deferred_restart_happens_once_a_peer_joins(c, s, a):
    kept = await leak_on_only_worker(c, s, a, 3)
    async with Nanny(s.address, nthreads=1, env={"CUDA_VISIBLE_DEVICES": "1"}) as peer:
        await wait_for(lambda: events(s, "restart"), timeout=30)
        (restart,) = events(s, "restart")
        assert restart["worker"] == a.worker_address
        assert (await kept).value == 3
        assert computed_once(s, "kept")
        await wait_for(lambda: len(s.workers) == 2 and all(gpus(s, w) == 1 for w in s.workers))
        assert peer.worker_address in s.workers


@gen_cluster(client=True, Worker=Nanny, nthreads=[("127.0.0.1", 1, cvd("0"))], timeout=60)
async def test_pools_freed_only_above_a_fraction(c, s, a):
    await accelsched.register(c, free_pools_above=0.25)  # 4 GiB of the 16 GiB device
    await verified(s, a)

    with dask.annotate(resources={"GPU": 1}):
        await c.submit(lambda: device_alloc(GiB).nbytes, key="small")
        assert await c.run(cached_on_device_0) == {a.worker_address: GiB}  # 1 GiB used: kept
        await c.submit(lambda: device_alloc(5 * GiB).nbytes, key="big")
        assert await c.run(cached_on_device_0) == {a.worker_address: 0}  # 6 GiB used: freed


@gen_cluster(client=True, Worker=Nanny, nthreads=TWO_GPU_WORKERS, timeout=90)
async def test_concurrent_restarts_lose_nothing(c, s, a, b):
    """A second restart starts while the first retired worker is being killed.

    The first retirement copied ``k`` to b; were b retired now, distributed would drop
    b's copy ("a still has it") just before a is killed. Retire-and-kill runs one worker
    at a time, so b's retirement waits until a is gone and keeps ``k``. But b drains
    meanwhile, and a draining worker is not running: distributed's memory manager drops
    the extra copy of a key from such workers first, so a pass of it between b's drain
    and a's end dropped b's copy, and ``k`` went with a (seen once, under load, on the
    oldest distributed). a's copies are forgotten before it is killed, b's is then the
    last and never dropped. The pass is run here, in that moment.
    """
    await accelsched.register(c, max_concurrent_restarts=2, **FAST)
    await verified(s, a, b)
    placement = s.plugins["accelsched-placement"]
    A, B = a.worker_address, b.worker_address
    k = await c.scatter({"k": 123}, workers=[A])
    second: list[asyncio.Task] = []
    # b's status and k's holders as a is killed, before and after a memory manager pass
    seen: list[tuple[Status, set[str], set[str]]] = []
    restart_workers = s.restart_workers

    async def restart_a_while_b_starts(workers, **kwargs):  # type: ignore[no-untyped-def]
        if workers == [A] and not second:
            assert placement.budget.request(s.workers[B].nanny, 0) is None
            second.append(
                asyncio.create_task(
                    placement.restart_worker(s.workers[B], s.workers[B].nanny, "leak")
                )
            )
            # let b's restart run as far as it may: until it waits for its turn to
            # retire (or, were nothing holding it back, until it is over)
            lock = placement._retire_lock
            await wait_for(lambda: second[0].done() or bool(lock._waiters), timeout=60)
            # (said after the restart: an error raised here is the restart's, logged)
            holders = {ws.address for ws in s.tasks["k"].who_has or ()}
            s.extensions["amm"].run_once()  # a pass of the memory manager, now
            after = {ws.address for ws in s.tasks["k"].who_has or ()}
            seen.append((s.workers[B].status, holders, after))
        return await restart_workers(workers, **kwargs)

    s.restart_workers = restart_a_while_b_starts
    assert placement.budget.request(s.workers[A].nanny, 0) is None
    await placement.restart_worker(s.workers[A], s.workers[A].nanny, "leak")
    await second[0]
    ((status, holders, after),) = seen
    assert status == Status.closing_gracefully  # b drains: not running
    assert holders == after == {B}  # a's copy forgotten: b's, the last, is kept
    assert await k["k"] == 123
    # a restarted; b waits for a peer to take k (a's replacement may not be there
    # yet) or restarted once one came: k is kept either way
    restarts = [e["worker"] for _, e in s.get_events(TOPIC) if e["action"] == "restart"]
    assert restarts[:1] == [A]


@gen_cluster(client=True, nthreads=GPU_WORKER, Worker=Worker, timeout=60)
async def test_a_check_while_a_gpu_task_starts_keeps_its_prefix(c, s, a):
    """A GPU task's prefix is recorded when it starts executing; its lease is taken in
    its thread a moment later. A check in between judged no device (none used yet) and
    counted as clean, forgetting the prefix: under load, a leak event named no suspect
    (a docs example failed so, now and then, on the oldest distributed). The moment is
    held open here by stopping the task's thread before its lease: under load it lasts
    milliseconds and cannot be hit on purpose."""
    await accelsched.register(c, **{**FAST, "check_interval": "1h"})  # checks run by hand
    await wait_for(lambda: gpus(s, a.address) == 1)
    guard = a.plugins["accelsched-guard"]
    leases = guard.binder.leases
    go = threading.Event()
    take = leases.grant

    def grant_later(*args: Any, **kwargs: Any) -> Any:
        go.wait(30)
        return take(*args, **kwargs)

    leases.grant = grant_later
    fut = c.submit(leaky, 1, resources={"GPU": 1}, key="leaky-1")
    await wait_for(lambda: "leaky-1" in leases.gpu_keys())
    guard.leaks.check()  # nothing judged: not clean
    go.set()
    assert await fut == 1
    for _ in range(FAST["leak_confirmations"]):
        guard.leaks.check()
    await wait_for(lambda: events(s, "leak"))
    (leak,) = events(s, "leak")
    assert "leaky" in leak["prefixes"], leak


@gen_cluster(client=True, Worker=Worker, nthreads=GPU_WORKER)
async def test_an_offer_its_workers_closing_cut_short_ends_quietly(c, s, a):
    """Results released as a worker restarts ask for offers, which may still run as it
    closes: one whose connections went ends quietly, naming its devices (before: the
    worker's log had a ``Task exception was never retrieved`` traceback per result,
    ``RuntimeError: ConnectionPool is closed``)."""
    await accelsched.register(c)
    await wait_for(lambda: gpus(s, a.address) == 1)
    guard = a.plugins[accelsched.GuardPlugin.name]
    await a.close()
    assert await guard.inventory.offer(guard._use_devices) == [0]


@gen_cluster(client=True, Worker=Worker, nthreads=GPU_WORKER)
async def test_unregistering_in_the_documented_order_logs_nothing_on_the_worker(c, s, a):
    """The guard first, then the placement plugin (docs/placement.md, to change options):
    the scheduler asks no worker whose guard went to report (before: the last heartbeat's
    guard metric said it had one, and the worker logged ``No handler accelsched_report``
    with a ``KeyError`` traceback)."""
    await accelsched.register(c)
    await wait_for(lambda: gpus(s, a.address) == 1)
    a.periodic_callbacks["heartbeat"].stop()  # (one landing in between would hide it)
    with captured_logger("distributed.core", level=logging.WARNING) as log:
        await c.unregister_worker_plugin(accelsched.GuardPlugin.name)
        await c.unregister_scheduler_plugin("accelsched-placement")
        await asyncio.sleep(0.5)  # (the scheduler's requests are answered by then)
    assert "accelsched" not in log.getvalue(), log.getvalue()
    a.periodic_callbacks["heartbeat"].start()
    await accelsched.register(c)  # and registered again, the GPU is verified again
    await wait_for(lambda: gpus(s, a.address) == 1)
