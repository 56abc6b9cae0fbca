"""Failure modes found in review, each pinned by a test on a real cluster."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import time
from collections import OrderedDict, defaultdict, namedtuple
from concurrent.futures import ProcessPoolExecutor

import dask
import pytest
from distributed import Event, Nanny, Worker
from distributed.core import Status
from distributed.utils_test import captured_logger, gen_cluster

import accelsched
import accelsched.scheduler.placement_plugin as actor_module
from accelsched import GuardPlugin
from accelsched.devices import to_host
from accelsched.protocol import GUARD_PLUGIN, PLACEMENT_PLUGIN
from accelsched.testing import device_alloc
from tests.utils import cvd, events, gpus, hold, inc, verified, wait_for

pytestmark = pytest.mark.usefixtures("fake_gpus_2")


@gen_cluster(client=True, nthreads=[("127.0.0.1", 2, {"resources": {"GPU": 2}})], timeout=30)
async def test_failed_drain_quarantines_before_taking_tasks_again(c, s, a):
    """GPU tasks that piled up during a drain must not land on the worker given up on."""
    old = actor_module.DRAIN_TIMEOUT
    actor_module.DRAIN_TIMEOUT = 1.0
    try:
        await accelsched.register(c)
        await wait_for(lambda: gpus(s, a.address) == 2)
        plugin = s.plugins["accelsched-placement"]
        with dask.annotate(resources={"GPU": 1}):
            busy = c.submit(hold, "x", returns=1, key="busy")
        await wait_for(lambda: "busy" in s.tasks and s.tasks["busy"].state == "processing")
        restart = asyncio.ensure_future(
            plugin.restart_worker(s.workers[a.address], "nanny", "leak")
        )
        await wait_for(lambda: s.workers[a.address].status == Status.closing_gracefully)
        with dask.annotate(resources={"GPU": 1}):
            late = c.submit(accelsched.current_device, key="late")
        await wait_for(lambda: "late" in s.tasks and s.tasks["late"].state == "no-worker")
        await restart
        assert [e["reason"] for e in events(s, "restart-deferred")] == ["busy"]
        assert s.tasks["late"].state == "no-worker" and gpus(s, a.address) == 0
        await Event("x").set()
        assert await busy == 1
        del late
    finally:
        actor_module.DRAIN_TIMEOUT = old


def innocent_after(go: str, started: str | None = None) -> str:
    """Allocates nothing: says it runs on ``Event(started)`` (watched by then: its first
    reading is taken), waits for ``Event(go)``, then runs on a while beside a rogue."""
    if started is not None:
        Event(started).set()
    Event(go).wait()
    time.sleep(0.3)
    return "innocent ok"


def rogue_after(go: str, started: str | None = None) -> int:
    """Says it runs on ``Event(started)``, then leaks 1 MiB on device 0 once ``Event(go)``
    is set: the growth a guard must not blame on a task beside it."""
    if started is not None:
        Event(started).set()
    Event(go).wait()
    return device_alloc(2**20, device=0, leak=True).nbytes


@gen_cluster(
    client=True,
    Worker=Nanny,
    nthreads=[("127.0.0.1", 2, cvd("0"))],
    timeout=30,
)
async def test_overlapping_cpu_tasks_are_not_blamed(c, s, a):
    await accelsched.register(c, unrequested_gpu="fail")
    await verified(s, a, count=1)
    fi = c.submit(innocent_after, "go", key="innocent")
    fr = c.submit(rogue_after, "go", key="rogue")
    await executing(c, a.worker_address, "innocent", "rogue")  # side by side
    await Event("go").set()
    assert await fi == "innocent ok"
    assert await fr == 2**20  # ran alongside another task: growth not attributable


async def executing(c, worker: str, *keys: str) -> None:  # type: ignore[no-untyped-def]
    """Wait until every one of ``keys`` executes on ``worker`` (counted as running there)."""
    want = {worker: ["executing"] * len(keys)}
    while await c.run(thread_states, keys, workers=[worker]) != want:
        await asyncio.sleep(0.02)


def thread_states(keys: tuple[str, ...], dask_worker: Worker) -> list[str | None]:
    return [thread_state(key, dask_worker) for key in keys]


def waits_for_go() -> str:
    Event("plain-started").set()  # watched: its first reading is taken by now
    Event("go").wait()
    return "ok"


@gen_cluster(
    client=True,
    Worker=Nanny,
    nthreads=[("127.0.0.1", 1, cvd("0"))],
    timeout=30,
)
async def test_other_processes_growth_is_not_blamed(c, s, a, fake_gpus_2):
    await accelsched.register(c, unrequested_gpu="fail")
    await verified(s, a, count=1)
    fake_gpus_2.set_flags(pid_offset=100000)  # a container without the host PID namespace
    fut = c.submit(waits_for_go, key="plain")
    await Event("plain-started").wait()
    device_alloc(2**30, device=0)  # another process on that GPU
    await Event("go").set()
    assert await fut == "ok"
    assert not events(s, "unrequested-gpu-use")


@gen_cluster(client=True, nthreads=[], timeout=30)
async def test_tasks_in_a_process_pool_are_not_wrapped(c, s):
    await accelsched.register(c)
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        async with Worker(s.address, nthreads=1, executor={"processes": pool}):
            with dask.annotate(executor="processes"):
                assert await c.submit(inc, 1, key="p") == 2


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)], timeout=30)
async def test_invalid_annotation_errs_again_on_retry(c, s, a):
    await accelsched.register(c)
    with dask.annotate(resources={"GPU": 1}, fallback_timeout="bogus"):
        fut = c.submit(inc, 1, key="bad")
    with pytest.raises(ValueError, match="'bogus'"):
        await fut
    await c.retry([fut])
    with pytest.raises(ValueError, match="'bogus'"):
        await fut


@gen_cluster(
    client=True,
    Worker=Nanny,
    nthreads=[("127.0.0.1", 1, cvd("0", resources={"GPU": 1}))],
    timeout=60,
)
async def test_unregistered_placement_steps_aside(c, s, a):
    await accelsched.register(c)
    await verified(s, a, count=1)
    await c.unregister_scheduler_plugin("accelsched-placement")
    old = a.worker_address
    await c.restart_workers([old])
    await wait_for(lambda: len(s.workers) == 1 and old not in s.workers)
    (new,) = s.workers
    await wait_for(lambda: gpus(s, new) == 1)  # no stale gate, no stale owner


@gen_cluster(
    client=True,
    Worker=Nanny,
    nthreads=[("127.0.0.1", 1, cvd("0", resources={"GPU": 1}))],
    timeout=60,
)
async def test_a_whole_cluster_restart_verifies_the_workers_that_come_back(c, s, a):
    """``client.restart()`` clears the scheduler's task state and replaces every worker:
    the new ones are verified and run GPU tasks."""
    await accelsched.register(c)
    await verified(s, a, count=1)
    old = a.worker_address
    await c.restart()
    await wait_for(lambda: len(s.workers) == 1 and old not in s.workers)
    await verified(s, a, count=1)
    with dask.annotate(resources={"GPU": 1}):
        assert await c.submit(inc, 1, pure=False) == 2
    assert not events(s, "gpu-waiting")


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1, {"resources": {"GPU": 1}})])
async def test_a_placement_plugin_registered_again_hears_the_guards_again(c, s, a):
    """Unregistered, the PlacementPlugin's handlers go, and it asks the guards to report:
    they learn from the scheduler's metadata that nobody listens, and send no more (before:
    a guard learnt it from its next offer, answered None by distributed, which logged
    ``No handler accelsched_offer`` with a traceback). Registered again, it asks the
    guards to report, and hears their offers again."""
    await accelsched.register(c)
    await wait_for(lambda: gpus(s, a.address) == 1)
    inventory = a.plugins[GUARD_PLUGIN].inventory
    with captured_logger("distributed.core") as scheduler_log:
        await c.unregister_scheduler_plugin("accelsched-placement")
        await wait_for(lambda: inventory.placement is False)
        await inventory.offer(lambda usable: None)
    assert "No handler" not in scheduler_log.getvalue(), scheduler_log.getvalue()
    await c.register_plugin(accelsched.PlacementPlugin())
    await wait_for(lambda: inventory.placement is True)
    await wait_for(lambda: gpus(s, a.address) == 1)
    with dask.annotate(resources={"GPU": 1}):
        assert await c.submit(inc, 1, pure=False) == 2


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1, {"resources": {"GPU": 1}})])
async def test_a_task_named_as_the_placement_metadata_leaves_it_said(c, s, a):
    """distributed drops a task's metadata under the task's key when it forgets the
    task: a task named ``accelsched-placement`` took the PlacementPlugin's word that it
    serves with it, and guards, ``accelsched.adapt`` and ``accelsched status`` would take
    the scheduler for one without accelsched. The plugin says it again."""
    await accelsched.register(c)
    await wait_for(lambda: gpus(s, a.address) == 1)
    future = c.submit(inc, 1, key=PLACEMENT_PLUGIN)
    assert await future == 2
    del future
    await wait_for(lambda: PLACEMENT_PLUGIN not in s.tasks)
    assert await c.get_metadata([PLACEMENT_PLUGIN]) is True


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1, {"resources": {"GPU": 1}})])
async def test_a_guard_registered_again_is_heard(c, s, a):
    """A GuardPlugin registered again (new options: ``register_plugin`` replaces it)
    sends its requests under ids its worker's process has not used: the scheduler
    remembers every id a process sent while it is registered (before: the new guard
    counted from 0 again, its report was refused as replayed, and it held no device)."""
    await accelsched.register(c)
    await verified(s, a, count=1)
    old = a.plugins[GUARD_PLUGIN]
    await c.register_plugin(GuardPlugin(leak_confirmations=3))
    new = a.plugins[GUARD_PLUGIN]
    assert new is not old
    await wait_for(lambda: [d.index for d in new.inventory.granted] == [0])
    with dask.annotate(resources={"GPU": 1}):
        assert await c.submit(accelsched.current_device, pure=False) == 0
    assert not events(s, "request-refused")


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)], timeout=30)
async def test_restart_request_from_another_address_than_advertised(c, s, peer):
    from distributed.utils import open_port

    await accelsched.register(c)
    port = open_port()
    async with Worker(
        s.address, host="0.0.0.0", port=port, contact_address=f"tcp://127.0.0.2:{port}"
    ) as w:
        await wait_for(lambda: w.plugins.get("accelsched-guard") is not None)
        w.plugins["accelsched-guard"].inventory.ask_restart("leak", 0)
        # confirmed by calling it back at its advertised address: not refused, but a
        # worker without a nanny cannot restart
        await wait_for(lambda: events(s, "restart-deferred"))
        assert events(s, "restart-deferred")[0]["reason"] == "no-nanny"
        assert not events(s, "request-refused")


def test_to_host_keeps_container_types() -> None:
    point = namedtuple("point", "x y")
    p = point(1, 2)
    assert to_host(p) is p
    d = defaultdict(list, a=[1])
    assert to_host(d) is d
    o = OrderedDict(b=1, a=2)
    assert to_host(o) is o
    assert to_host([1, (2, 3)]) == [1, (2, 3)]


def thread_state(key: str, dask_worker: Worker) -> str | None:
    ts = dask_worker.state.tasks.get(key)
    return None if ts is None else ts.state


@gen_cluster(
    client=True,
    Worker=Nanny,
    nthreads=[("127.0.0.1", 2, cvd("0"))],
    timeout=30,
)
async def test_a_cancelled_task_still_running_is_not_blamed_on_another(c, s, a):
    """A task cancelled while it executes keeps running in its thread (distributed cannot
    stop it): what it allocates then must not be blamed on a task that starts beside it."""
    await accelsched.register(c, unrequested_gpu="fail")
    await verified(s, a, count=1)
    rogue = c.submit(rogue_after, "cancelled-go", "cancelled-started", key="rogue")
    await Event("cancelled-started").wait()
    await c.cancel(rogue)
    del rogue
    while await c.run(thread_state, "rogue", workers=[a.worker_address]) != {
        a.worker_address: "cancelled"
    }:
        await asyncio.sleep(0.02)
    innocent = c.submit(
        innocent_after, "cancelled-go", "cancelled-innocent-started", key="innocent"
    )
    await Event("cancelled-innocent-started").wait()
    await Event("cancelled-go").set()
    assert await innocent == "innocent ok"
    assert not events(s, "unrequested-gpu-use")


def running_count() -> int:
    from accelsched.worker.guard_plugin import TABLES

    return sum(table.running() for table in TABLES)


def guard_confirmations(dask_worker: Worker) -> int:
    return dask_worker.plugins[GUARD_PLUGIN].options["leak_confirmations"]


@gen_cluster(
    client=True,
    Worker=Nanny,
    nthreads=[("127.0.0.1", 2, cvd("0"))],
    timeout=30,
)
async def test_a_task_running_when_the_guard_is_registered_again_still_counts(c, s, a):
    """A GuardPlugin registered again (new options: ``register_plugin`` replaces it) on a
    worker whose tasks run on: one that started under the old guard must still count as
    running, or what it allocates is blamed on a task that starts beside it."""
    await accelsched.register(c, unrequested_gpu="fail")
    await verified(s, a, count=1)
    rogue = c.submit(rogue_after, "rerun-go", "rerun-started", key="rogue")
    await Event("rerun-started").wait()
    await c.register_plugin(GuardPlugin(unrequested_gpu="fail", leak_confirmations=3))
    replaced = await c.run(guard_confirmations)
    assert replaced == {a.worker_address: 3}
    innocent = c.submit(innocent_after, "rerun-go", "innocent-started", key="innocent")
    await Event("innocent-started").wait()
    await Event("rerun-go").set()
    assert await innocent == "innocent ok"
    assert await rogue == 2**20
    assert not events(s, "unrequested-gpu-use")
    # and both were uncounted as they ended: nothing counted twice, nothing left over
    assert await c.run(running_count) == {a.worker_address: 0}


def test_the_workers_listed_are_fetched_for_the_call_not_the_clients_cached_identity(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``Client.scheduler_info(n_workers=-1)`` refreshes the client's cached identity and
    returns it, and the client's periodic refresh replaces it with one listing no worker:
    landing in between, that made a test waiting for a pool's workers to go see them gone
    while one still ran (1 call in about 70,000 on a busy host). The periodic refresh is
    made to land in between here (its call, ``_update_scheduler_info()``, right after the
    fetch), rather than waited for."""
    from distributed import Client, LocalCluster

    from accelsched import internals

    with (
        LocalCluster(n_workers=2, processes=False, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        client.wait_for_workers(2)
        fetch = client._update_scheduler_info

        async def fetch_then_periodic(n_workers: int = 0) -> None:
            await fetch(n_workers=n_workers)
            await fetch()  # the periodic refresh's own call, landing before the read

        monkeypatch.setattr(client, "_update_scheduler_info", fetch_then_periodic)
        assert client.scheduler_info(n_workers=-1)["workers"] == {}  # the race, forced
        listed = internals.workers_listed(client)
        assert sorted(w["name"] for w in listed.values()) == [0, 1]
        assert set(listed) == set(cluster.scheduler.workers)
