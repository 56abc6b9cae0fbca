"""Requests and orders reach the process they are about, once.

Nothing here is about hostile callers: anyone connected is trusted, as in distributed
(docs/architecture.md). Every request from a worker names its process and carries an id
that process uses once, so a stale request (from a process since replaced at that
address) or a replayed one is refused; the scheduler's drain order names the process it
is meant for. The numbers are in tests/decisions/test_units.py; here, real clusters.
"""

from __future__ import annotations

import asyncio
from time import monotonic
from typing import Any

import pytest
from distributed import Event, Nanny, Worker
from distributed.core import rpc
from distributed.utils import open_port
from distributed.utils_test import gen_cluster

import accelsched
from accelsched.protocol import DRAIN_HANDLER, INVENTORY_HANDLER, OFFER_HANDLER, RESTART_HANDLER
from accelsched.worker.leak_check import RESTART_TAKEN_HOLD
from tests.utils import GPU_WORKER, background, cvd, events, gpus, settled, wait_for

# --- on a cluster -----------------------------------------------------------------------------


def guard(dask_worker: Any) -> Any:
    return dask_worker.plugins["accelsched-guard"]


def step(x: int) -> int:
    Event("go").wait()
    return x


@pytest.mark.usefixtures("fake_gpus_2")
@gen_cluster(client=True, nthreads=GPU_WORKER, Worker=Worker, timeout=60)
async def test_a_drain_order_meant_for_another_process_is_refused(c, s, a):
    """A drain order for the process that had this address before (a restart's order
    arriving late) must not make the fresh worker send every GPU task back."""
    await accelsched.register(c)
    await wait_for(lambda: gpus(s, a.address) == 1)
    misdirected = [{"on": True}, {"on": True, "process": "Worker-gone"}]
    async with rpc(a.address) as r:
        for kwargs in misdirected:
            assert (await getattr(r, DRAIN_HANDLER)(**kwargs))["status"] == "refused", kwargs
        reply = await getattr(r, DRAIN_HANDLER)(on="yes", process=a.id)
        assert reply["status"] == "invalid"
    assert guard(a).inventory.draining is False
    # the worker runs its GPU task, once
    go = Event("go")
    fut = c.submit(accelsched.gpu(step), 1, key="task")
    await wait_for(
        lambda: a.state.tasks.get("task") is not None and a.state.tasks["task"].state == "executing"
    )
    await go.set()
    assert await fut == 1
    story = s.story("task")
    assert story and not [m for m in story if "reschedule" in str(m[4])], story


@pytest.mark.usefixtures("fake_gpus_2")
@gen_cluster(client=True, nthreads=GPU_WORKER, Worker=Worker, timeout=60)
async def test_the_schedulers_own_drain_order_is_obeyed(c, s, a):
    await accelsched.register(c)
    await wait_for(lambda: gpus(s, a.address) == 1)
    actor = s.plugins["accelsched-placement"]  # the one that acts
    await actor.tell_draining(a.address, True)
    assert guard(a).inventory.draining is True
    await actor.tell_draining(a.address, False)
    assert guard(a).inventory.draining is False
    assert not events(s, "request-refused")


@pytest.mark.usefixtures("fake_gpus_2")
@gen_cluster(client=True, nthreads=GPU_WORKER, Worker=Worker, timeout=60)
async def test_a_replayed_request_is_acted_on_once(c, s, a):
    """Before: two racing requests on one id were both acted on."""
    await accelsched.register(c)
    await wait_for(lambda: gpus(s, a.address) == 1)
    said = {"worker": a.address, "process": a.id, "request": "replayed-id"}
    async with rpc(s.address) as r:
        # two racing requests on the one id: at most one is acted on
        replies = await asyncio.gather(
            *(getattr(r, RESTART_HANDLER)(**said, reason="leak", nbytes=1) for _ in range(2))
        )
        # and the id is spent for every handler
        assert (await getattr(r, OFFER_HANDLER)(**said, count=0))["status"] == "refused"
    statuses = sorted(x["status"] for x in replies)
    assert statuses[-1] == "refused", statuses  # one acted on (deferred: no peer), one not
    assert statuses[0] != "refused", statuses
    refused = events(s, "request-refused")
    assert [(e["worker"], e["reason"]) for e in refused] == [(a.address, "replayed")] * 2


@pytest.mark.usefixtures("fake_gpus_2")
@gen_cluster(client=True, nthreads=GPU_WORKER, Worker=Worker, timeout=60)
async def test_a_request_from_another_process_is_refused(c, s, a):
    """A request naming this worker's address from a process the scheduler does not hold
    there (one since replaced) changes nothing: no grant, no offer, no restart."""
    await accelsched.register(c)
    await wait_for(lambda: gpus(s, a.address) == 1)
    grants = s.plugins["accelsched-placement"].grants
    before = (grants.of(a.address), dict(grants._workers), dict(s.workers[a.address].resources))
    started = background(s)
    stale = {"worker": a.address, "process": "Worker-gone"}
    async with rpc(s.address) as r:
        replies = [
            await getattr(r, INVENTORY_HANDLER)(
                **stale, request="1", devices=[], requested=0, declared=1
            ),
            await getattr(r, OFFER_HANDLER)(**stale, request="2", count=0),
            await getattr(r, RESTART_HANDLER)(**stale, request="3", reason="leak", nbytes=1),
            # the worker's own process, without an id
            await getattr(r, RESTART_HANDLER)(worker=a.address, process=a.id, reason="leak"),
        ]
    assert [x["status"] for x in replies] == ["refused"] * 4, replies
    await settled(s, started)
    after = (grants.of(a.address), dict(grants._workers), dict(s.workers[a.address].resources))
    assert after == before
    assert not events(s, "restart-deferred") and not events(s, "restart")
    assert [(e["handler"], e["reason"]) for e in events(s, "request-refused")] == [
        (INVENTORY_HANDLER, "stale"),
        (OFFER_HANDLER, "stale"),
        (RESTART_HANDLER, "stale"),
        (RESTART_HANDLER, "no-id"),
    ]


@pytest.mark.usefixtures("fake_gpus_2")
@gen_cluster(client=True, nthreads=GPU_WORKER, Worker=Worker, timeout=60)
async def test_an_offer_naming_its_devices_oddly_is_invalid(c, s, a):
    """The offered devices' UUIDs say which capacity declared tasks get: anything but a
    list of names changes nothing."""
    await accelsched.register(c)
    await wait_for(lambda: gpus(s, a.address) == 1)
    before = dict(s.workers[a.address].resources)
    async with rpc(s.address) as r:
        granted = s.plugins["accelsched-placement"].grants.uuids(a.address)
        odd_ones = [
            ("GPU-1", 0),
            ([1], 1),
            ({"GPU-1": 1}, 1),
            ([None], 1),
            (["GPU-never-granted"], 1),  # no device of its grant
            (granted, 0),  # names more than it offers
            ([], 1),  # offers more than it names
        ]
        for n, (odd, count) in enumerate(odd_ones):
            said = {"worker": a.address, "process": a.id, "request": f"odd-{n}"}
            reply = await getattr(r, OFFER_HANDLER)(**said, count=count, uuids=odd)
            assert reply == {"status": "invalid", "count": 0}, odd
    assert dict(s.workers[a.address].resources) == before


#: A fixed worker port: the restarted process takes its predecessor's address.
PORT = open_port()


@pytest.mark.usefixtures("fake_gpus_2")
@gen_cluster(
    client=True,
    Worker=Nanny,
    nthreads=[("127.0.0.1", 1, cvd("0", resources={"GPU": 1}, worker_port=PORT))],
    timeout=90,
)
async def test_a_late_request_of_a_replaced_process_does_not_restart_its_successor(c, s, a):
    """The worker restarts at the same address; a restart request of the old process
    arriving now (late, retried) must not restart the fresh one."""
    await accelsched.register(c)
    address = a.worker_address
    await wait_for(lambda: gpus(s, address) == 1)
    old = s.workers[address].server_id
    await c.restart_workers([address])
    await wait_for(lambda: address in s.workers and s.workers[address].server_id != old)
    await wait_for(lambda: gpus(s, address) == 1)
    new = s.workers[address].server_id
    started = background(s)
    async with rpc(s.address) as r:
        reply = await getattr(r, RESTART_HANDLER)(
            worker=address, process=old, request="1", reason="leak", nbytes=2**30
        )
    assert reply["status"] == "refused"
    await settled(s, started)
    assert s.workers[address].server_id == new and gpus(s, address) == 1
    assert not events(s, "restart") and not events(s, "restart-deferred")
    (refused,) = events(s, "request-refused")
    assert (refused["worker"], refused["reason"]) == (address, "stale")


@pytest.mark.usefixtures("fake_gpus_2")
@gen_cluster(client=True, nthreads=GPU_WORKER, Worker=Worker, timeout=60)
async def test_a_worker_whose_restart_was_taken_does_not_ask_again_meanwhile(c, s, a):
    """An accepted (or in-flight) restart request holds the worker's next one for the
    same reason back for a while: its process is being replaced."""
    await accelsched.register(c)
    await wait_for(lambda: gpus(s, a.address) == 1)
    inventory = guard(a).inventory
    sent: list[dict] = []
    handler = s.handlers[RESTART_HANDLER]

    async def in_flight(comm: Any = None, **request: Any) -> dict:
        sent.append(request)
        return {"status": "in-flight"}

    s.handlers[RESTART_HANDLER] = in_flight  # the scheduler's word, without a restart
    try:
        inventory.ask_restart("leak", 1)
        await wait_for(lambda: len(sent) == 1 and not inventory.restart_pending)
        assert inventory.restart_taken["leak"] > monotonic() + RESTART_TAKEN_HOLD - 1
        inventory.ask_restart("leak", 1)  # held back
        await asyncio.sleep(0.1)
        assert len(sent) == 1 and not inventory.restart_pending
        # another reason is sent: a failing GPU asks once, and must not be lost
        inventory.ask_restart("gpu-unhealthy", 0)
        await wait_for(lambda: len(sent) == 2 and not inventory.restart_pending)
        assert sent[1]["reason"] == "gpu-unhealthy"
        inventory.restart_taken["leak"] = 0.0  # the hold over: asked again
        inventory.ask_restart("leak", 1)
        await wait_for(lambda: len(sent) == 3)
    finally:
        s.handlers[RESTART_HANDLER] = handler
