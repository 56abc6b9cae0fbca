"""A leaking worker with a long queue restarts without working through it first.

distributed sends every GPU-restricted task to a valid worker at once, so each worker of
a busy cluster holds a queue. A restart that waited for the whole queue would let the leak
grow for as long as the queue runs; the drain sends the queued tasks back instead.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from distributed import Nanny
from distributed.utils_test import gen_cluster

import accelsched
from accelsched.protocol import PLACEMENT_PLUGIN
from accelsched.testing import device_alloc
from tests.utils import FAST, TWO_GPU_WORKERS, MiB, events, gpus, wait_for

pytestmark = pytest.mark.usefixtures("fake_gpus_2")

N = 120
#: Checks twice as often as FAST: a leak is declared before the queue is worked through.
GUARD = {**FAST, "check_interval": "50ms"}


def work(i: int) -> int:
    if i == 2:
        device_alloc(512 * MiB, leak=True)
    time.sleep(0.03)
    return i


#: Two nanny workers, one fake GPU each.
TWO_GPU_NANNIES: dict = dict(
    client=True,
    Worker=Nanny,
    nthreads=TWO_GPU_WORKERS,
    timeout=120,
)


@gen_cluster(**TWO_GPU_NANNIES)
async def test_queue_goes_back_when_a_leaking_worker_restarts(c, s, a, b):
    await accelsched.register(c, **GUARD)
    await wait_for(lambda: gpus(s, a.worker_address) == gpus(s, b.worker_address) == 1, 30)
    futures = c.map(work, range(N), resources={"GPU": 1}, pure=False)
    await wait_for(lambda: events(s, "restart"), timeout=90)
    (restart,) = events(s, "restart")
    assert restart["assigned"] > 1  # restarted with a queue: it went back, not waited for
    assert await c.gather(futures) == list(range(N))  # nothing lost, nothing failed
    await wait_for(lambda: sum(gpus(s, w) for w in s.workers) == 2, 30)  # re-verified


def where(i: int) -> str:
    from distributed import get_worker

    work(i)
    return get_worker().address


def where_slowly(i: int) -> str:
    """:func:`where`, a tenth of a second longer: the peer's queue outlasts a restart even
    on a loaded machine, so what the new process takes of it can be judged."""
    time.sleep(0.1)
    return where(i)


@gen_cluster(**TWO_GPU_NANNIES)
async def test_a_quarantined_worker_sends_its_queue_back(c, s, a, b):
    """No restart allowed (``max_restarts=0``): the leaking worker is quarantined, and the
    GPU tasks already sent to it run on the other worker, not on it."""
    await accelsched.register(c, max_restarts=0, **GUARD)
    await wait_for(lambda: gpus(s, a.worker_address) == gpus(s, b.worker_address) == 1, 30)
    futures = c.map(where, range(N), resources={"GPU": 1}, pure=False)
    ran_on = await c.gather(futures)  # nothing lost, nothing failed
    (quarantine,) = events(s, "quarantine")
    leaking = quarantine["worker"]
    # distributed split the queue evenly at submission; the leaking worker ran only what
    # it had started before the quarantine, the rest went to its peer
    assert ran_on.count(leaking) < N // 4
    assert not events(s, "restart")


@gen_cluster(**TWO_GPU_NANNIES)
async def test_a_restarted_worker_takes_its_share_of_its_peers_queue(c, s, a, b):
    """The leaking worker's queue goes to its peer at once (work stealing's protocol); the
    restarted process, once its GPU is verified, takes its share back instead of idling
    while its peer works through everything (distributed placed every task at submission)."""
    await accelsched.register(c, **GUARD)
    await wait_for(lambda: gpus(s, a.worker_address) == gpus(s, b.worker_address) == 1, 30)
    before = {a.worker_address, b.worker_address}
    futures = c.map(where_slowly, range(N), resources={"GPU": 1}, pure=False)

    def new_process_verified() -> bool:
        """the restarted process's GPU verified"""
        return any(gpus(s, w) == 1 for w in s.workers if w not in before)

    await wait_for(new_process_verified, timeout=60)
    # what the new process could take a share of: how long its restart took is the
    # machine's business, what it does with what is left is accelsched's
    left = sum(not f.done() for f in futures)
    ran_on = await c.gather(futures)  # nothing lost, nothing failed
    (restart,) = events(s, "restart")
    assert restart["assigned"] > 1
    assert left >= N // 10, left  # the queue outlasted the restart: the check means something
    counts = {w: ran_on.count(w) for w in set(ran_on)}
    # a good part of what was left at its start, not one stray task (an even split is half)
    new = [w for w in s.workers if w not in before]  # the new process's address
    assert len(new) == 1 and counts.get(new[0], 0) >= left // 4, (left, counts, new)


def where_now(i: int) -> str:
    from distributed import get_worker

    return get_worker().address


@gen_cluster(**TWO_GPU_NANNIES)
async def test_a_quarantine_outlasts_registering_again(c, s, a, b):
    """Unregistering both plugins and registering again, as the docs say to change an
    option, keeps a quarantined worker out of placement while its process runs, and the
    restarts taken count against the new budget (before: its GPU was placed on again at
    once, until its new guard found the leak a second time)."""
    await accelsched.register(c, max_restarts=0, **GUARD)
    await wait_for(lambda: gpus(s, a.worker_address) == gpus(s, b.worker_address) == 1, 30)
    await c.gather(c.map(work, range(10), resources={"GPU": 1}, pure=False))
    await wait_for(lambda: events(s, "quarantine"), 60)
    (quarantine,) = events(s, "quarantine")
    leaking = quarantine["worker"]
    (peer,) = {a.worker_address, b.worker_address} - {leaking}
    await c.unregister_worker_plugin("accelsched-guard")
    await c.unregister_scheduler_plugin(PLACEMENT_PLUGIN)
    await accelsched.register(c, max_restarts=0, fallback_timeout="10s", **GUARD)
    grants = s.plugins[PLACEMENT_PLUGIN].grants
    await wait_for(lambda: grants.of(leaking).reported and gpus(s, peer) == 1, 30)
    assert gpus(s, leaking) == 0 and grants.of(leaking).quarantined == "restart-budget"

    def draining(dask_worker: Any) -> bool:
        return dask_worker.plugins["accelsched-guard"].inventory.draining

    # its new guard sends back what was already queued on it, as the old one did
    assert (await c.run(draining, workers=[leaking]))[leaking] is True
    ran_on = await c.gather(c.map(where_now, range(20), resources={"GPU": 1}, pure=False))
    assert set(ran_on) == {peer}
    assert len(events(s, "quarantine")) == 1  # the same quarantine, not a second one
