"""Where a requirement task may run, whatever the order of joins, leaves and restarts.

The invariant: a GPU task that says what its device must be is placeable on every live
worker with granted devices that meet it (within its own ``workers=`` restriction), and
on no other, in every state, placed tasks included.

The model-based test drives the scheduler's own parts (:class:`Grants`, :class:`Fallback`)
on a real distributed ``Scheduler`` with tasks made by its own ``new_task``; workers
joining and leaving are the calls the plugin makes for them (the grant of a guard's
report, ``remove_worker``). No worker process exists: hypothesis runs hundreds of
orders in seconds, which real workers could not. The reproductions below it run the
same stories on real nanny workers.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter
from typing import Any

import dask
import pytest
from distributed import Nanny, Scheduler
from distributed.utils_test import gen_cluster
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import accelsched
from accelsched.policy.requirements import DeviceFacts, parse_requirement
from accelsched.protocol import GPU, PLACEMENT_PLUGIN, REQUIREMENT_ANNOTATION, DeviceRecord
from accelsched.scheduler.fallback import BENCH, NOWHERE, Fallback
from accelsched.scheduler.grants import Grants
from accelsched.testing import fake_gpus
from tests.utils import A100, H100, cvd, events, gpus, wait_for

GiB = 2**30

#: The devices a joining worker may have.
DEVICES: dict[str, DeviceFacts] = {
    "h100": DeviceFacts(H100, 80 * GiB, (9, 0)),
    "a100": DeviceFacts(A100, 40 * GiB, (8, 0)),
    "small": DeviceFacts("NVIDIA T4", 16 * GiB, (7, 5)),
}
#: What tasks may ask of their device.
NEEDS: list[dict[str, Any]] = [
    {"memory": 30 * GiB},
    {"memory": 2 * GiB},
    {"model": "*A100*"},
    {"capability": [8, 0]},
    {"memory": 60 * GiB, "capability": [9, 0]},
]
ADDRESSES = [f"tcp://10.0.0.{i}:1234" for i in range(6)]


def _record(kind: str, uuid: str) -> DeviceRecord:
    f = DEVICES[kind]
    capability = None if f.capability is None else list(f.capability)
    return {"index": 0, "uuid": uuid, "name": f.name, "memory": f.memory, "capability": capability}


class Eligibility(RuleBasedStateMachine):
    """Joins, leaves, restarts (the same address, maybe other devices) and tasks, in any
    order, against a model of who holds what."""

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.scheduler = self.loop.run_until_complete(self._scheduler())
        self.grants = Grants(share_gpus=False)
        self.fallback = Fallback(
            self.scheduler,
            timeout=None,
            interval=3600,
            grants=self.grants,
            emit=lambda *a, **kw: None,
            active=lambda: True,
            act=lambda proposals, **kw: None,
        )
        self.live: dict[str, list[str]] = {}  # the model: worker -> its device kinds
        self.tasks: dict[str, tuple[dict[str, Any], frozenset[str] | None]] = {}
        self.uuids = itertools.count()
        self.keys = itertools.count()

    async def _scheduler(self) -> Scheduler:
        return Scheduler(validate=True, dashboard_address=":0")

    def teardown(self) -> None:
        self.fallback.close()
        self.loop.run_until_complete(self.scheduler.close())
        self.loop.close()

    @rule(
        worker=st.sampled_from(ADDRESSES),
        kinds=st.lists(st.sampled_from(sorted(DEVICES)), min_size=1, max_size=2),
    )
    def join(self, worker: str, kinds: list[str]) -> None:
        """A worker's guard reports its devices and they are granted (a restart at the
        same address reports again: its grant is replaced)."""
        records = [_record(k, f"GPU-{next(self.uuids)}") for k in kinds]
        self.grants.claim(worker, records)
        self.fallback.follow(worker)
        self.live[worker] = kinds

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def leave(self, data: st.DataObject) -> None:
        worker = data.draw(st.sampled_from(sorted(self.live)))
        self.grants.remove(worker)
        self.fallback.follow(worker)
        del self.live[worker]

    @rule(
        need=st.sampled_from(range(len(NEEDS))),
        own=st.none() | st.frozensets(st.sampled_from(ADDRESSES), min_size=1, max_size=3),
        state=st.sampled_from(["released", "no-worker", "processing", "memory"]),
    )
    def submit(self, need: int, own: frozenset[str] | None, state: str) -> None:
        """A new requirement task, then wherever distributed took it since."""
        key = f"task-{next(self.keys)}"
        ts = self.scheduler.new_task(key, None, "released")
        ts.resource_restrictions = {GPU: 1}
        ts.annotations = {REQUIREMENT_ANNOTATION: NEEDS[need]}
        ts.worker_restrictions = set(own) if own else None
        self.fallback.prepare([key])
        ts.state = state  # eligibility must not depend on it
        self.tasks[key] = (NEEDS[need], own)

    @precondition(lambda self: self.tasks)
    @rule(data=st.data())
    def forget(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.tasks)))
        self.fallback.transition(key, "memory", "forgotten", "")
        del self.scheduler.tasks[key]
        del self.tasks[key]

    @invariant()
    def placeable_exactly_where_its_devices_are(self) -> None:
        for key, (need, own) in self.tasks.items():
            requirement = parse_requirement(need)
            meet = {
                w
                for w, kinds in self.live.items()
                if any(requirement.fits(DEVICES[k]) for k in kinds) and (own is None or w in own)
            }
            restriction = self.scheduler.tasks[key].worker_restrictions
            assert restriction, f"{key}: an empty restriction means anywhere"
            assert set(restriction) - {NOWHERE} == meet, (key, need, own, self.live)

    @invariant()
    def a_class_goes_with_its_last_task(self) -> None:
        assert len(self.fallback._classes) <= len(self.tasks)


def test_eligibility_follows_joins_leaves_and_restarts() -> None:
    run_state_machine_as_test(
        Eligibility,
        settings=settings(
            max_examples=50,
            stateful_step_count=30,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )


# --- the reproductions, on real nanny workers ---------------------------------------------


@accelsched.gpu(memory="1GiB")
def strict_step(i: int) -> int:
    time.sleep(0.5)
    return i


@accelsched.gpu(memory="1GiB")
def short_step(i: int) -> int:
    time.sleep(0.05)
    return i


@pytest.mark.usefixtures("fake_gpus_2")
@gen_cluster(client=True, Worker=Nanny, nthreads=[("127.0.0.1", 1, cvd("0"))], timeout=90)
async def test_a_placed_requirement_task_follows_to_a_worker_verified_after_it(c, s, a):
    """Placed on a, b verified later, a gone: the tasks run on b (they stayed
    ``no-worker`` restricted to a's dead address)."""
    await accelsched.register(c, fast_restart=False)
    await wait_for(lambda: len(events(s, "gpu-verified")) == 1)
    futures = c.map(strict_step, range(4), pure=False)
    await wait_for(lambda: any(ts.state == "processing" for ts in s.tasks.values()))
    async with Nanny(s.address, nthreads=1, **cvd("1")) as b:
        await wait_for(lambda: len(events(s, "gpu-verified")) == 2)
        await a.close()
        assert sorted(await asyncio.wait_for(c.gather(futures), 30)) == [0, 1, 2, 3]
        ran_on = {ts.who_has and next(iter(ts.who_has)).address for ts in s.tasks.values()}
        assert ran_on == {b.worker_address}


@gen_cluster(client=True, nthreads=[], timeout=120)
async def test_requirement_tasks_submitted_before_the_workers_spread_over_them(c, s):
    """Submitted before any worker joins (start-up, scale-up): they spread over the
    workers verified later (they all ran on the first, which alone had been added to
    their restrictions)."""
    await accelsched.register(c, fast_restart=False)
    futures = c.map(short_step, range(200), pure=False)
    await wait_for(lambda: len(s.tasks) == 200)
    with fake_gpus(count=4, memory="16GiB"):
        nannies = [Nanny(s.address, nthreads=1, **cvd(str(i))) for i in range(4)]
        await asyncio.gather(*nannies)
        try:
            await asyncio.wait_for(c.gather(futures), 60)
            ran = Counter(next(iter(s.tasks[f.key].who_has)).address for f in futures)
        finally:
            await asyncio.gather(*(n.close() for n in nannies))
    assert len(ran) >= 2, ran
    assert max(ran.values()) <= 0.4 * 200, ran


@accelsched.gpu(memory="1GiB")
def declared_step(i: int) -> int:
    time.sleep(0.3)
    return i


def test_declared_tasks_queued_behind_a_withdrawn_device_run_elsewhere() -> None:
    """Declared-memory tasks queued on a worker whose only device fails (no restart
    allowed, a healthy peer): they run on the peer (one stayed ``processing`` on the
    worker for good: its ``GPU-memory`` went to 0, nothing sent them back), and once the
    device answers again the worker takes declared tasks again."""

    two_threads_each = [("127.0.0.1", 2, cvd("0")), ("127.0.0.1", 2, cvd("1"))]

    @gen_cluster(client=True, Worker=Nanny, nthreads=two_threads_each, timeout=120)
    async def run(c, s, a, b):  # type: ignore[no-untyped-def]
        await accelsched.register(c, check_interval="100ms", max_restarts=0, fast_restart=False)
        await wait_for(lambda: gpus(s, a.worker_address) == gpus(s, b.worker_address) == 1)
        futures = c.map(declared_step, range(40), pure=False)
        on_a = s.workers[a.worker_address].processing
        await wait_for(lambda: len(on_a) >= 6)
        fails.fail(0)
        await wait_for(lambda: s.workers[a.worker_address].resources.get("GPU-memory") == 0)
        assert sorted(await asyncio.wait_for(c.gather(futures), 60)) == list(range(40))
        fails.recover()
        await wait_for(lambda: events(s, "gpu-recovered"))
        await wait_for(lambda: gpus(s, a.worker_address) == 1)
        again = c.map(declared_step, range(12), pure=False)
        assert sorted(await asyncio.wait_for(c.gather(again), 60)) == list(range(12))
        assert any(a.worker_address in {w.address for w in s.tasks[f.key].who_has} for f in again)

    with fake_gpus(2) as fails:
        run()


def test_declared_memory_offered_is_that_of_the_devices_still_offered() -> None:
    """A worker of an 80 GiB and a 16 GiB device whose large one is withdrawn offers
    declared tasks the small one's capacity (it offered the first device's: the 80 GiB
    that was withdrawn, so tasks that only it could hold were sent there)."""
    from accelsched.policy.requirements import capacity, mebibytes

    both = [("127.0.0.1", 2, cvd("0,1", resources={"GPU": 2}))]

    @gen_cluster(client=True, Worker=Nanny, nthreads=both, timeout=90)
    async def run(c, s, a):  # type: ignore[no-untyped-def]
        await accelsched.register(c, check_interval="100ms", max_restarts=0, fast_restart=False)
        await wait_for(lambda: gpus(s, a.worker_address) == 2)
        memory = s.workers[a.worker_address].resources
        assert memory["GPU-memory"] == mebibytes(capacity(80 * 2**30) + capacity(16 * 2**30))
        fails.fail(0)
        await wait_for(lambda: gpus(s, a.worker_address) == 1)
        assert memory["GPU-memory"] == mebibytes(capacity(16 * 2**30))
        fails.recover()
        await wait_for(lambda: gpus(s, a.worker_address) == 2)
        assert memory["GPU-memory"] == mebibytes(capacity(80 * 2**30) + capacity(16 * 2**30))

    with fake_gpus(2, memory=["80GiB", "16GiB"]) as fails:
        run()


@accelsched.gpu(memory="1GiB")
def small_step(i: int) -> tuple[float, float]:
    """Of staggered lengths: some always holds the device while the stream flows."""
    start = time.time()
    time.sleep(0.2 + (i % 5) * 0.07)
    return start, time.time()


def whole_step() -> tuple[float, float]:
    start = time.time()
    time.sleep(0.1)
    return start, time.time()


@pytest.mark.usefixtures("fake_gpus_2")
@gen_cluster(client=True, nthreads=[("127.0.0.1", 6, {"resources": {"GPU": 1}})], timeout=90)
async def test_a_whole_device_task_starts_once_the_declared_tasks_before_it_end(c, s, a):
    """A whole-device task submitted into a steady stream of small declared tasks on
    the same device starts once the tasks holding the device end: only tasks already
    handed a thread start in between (it waited until the stream ended, every new one
    packing onto the device it waited for)."""
    await accelsched.register(c, fast_restart=False)
    await wait_for(lambda: gpus(s, a.address) == 1)
    stream: list[Any] = []

    async def flow() -> None:  # a steady stream: two new tasks every tenth of a second
        for i in range(0, 120, 2):
            stream.extend(c.map(small_step, [i, i + 1], pure=False))
            await asyncio.sleep(0.1)

    flowing = asyncio.create_task(flow())
    await asyncio.sleep(1.5)
    submitted = time.time()
    with dask.annotate(resources={"GPU": 1}):
        whole = c.submit(whole_step, pure=False)
    start, end = await whole
    await flowing
    spans = await c.gather(stream)
    between = [s0 for s0, _ in spans if submitted < s0 < start]
    assert len(between) <= 6, (len(between), start - submitted)
    assert not [1 for s0, e0 in spans if s0 < end and e0 > start], "it held the device alone"


@accelsched.gpu(memory="1GiB")
def holds_until(name: str) -> str:
    from distributed import Event

    assert Event(name).wait(30)
    return "held"


def whole_and_marked(name: str) -> str:
    from distributed import Variable

    Variable(name).set("ran")
    return "ran"


@pytest.mark.usefixtures("fake_gpus_2")
@gen_cluster(client=True, nthreads=[("127.0.0.1", 3, {"resources": {"GPU": 1}})], timeout=60)
async def test_a_whole_device_task_cancelled_while_it_waits_stops_and_frees_its_claim(c, s, a):
    """It waited on in its thread, claiming the device from declared tasks, and ran
    once the device was free, though nobody wanted its result."""
    from distributed import Event, Variable

    from accelsched.protocol import GUARD_PLUGIN

    await accelsched.register(c, fast_restart=False)
    await wait_for(lambda: gpus(s, a.address) == 1)
    binder = a.plugins[GUARD_PLUGIN].binder
    await Variable("whole-ran").set("no")
    held = c.submit(holds_until, "let-go", pure=False)
    await wait_for(lambda: len(binder.leases.holders()) == 1)
    with dask.annotate(resources={"GPU": 1}):
        whole = c.submit(whole_and_marked, "whole-ran", pure=False)
    await wait_for(lambda: binder._waiting == 1)  # in its thread, claiming the device
    await c.cancel([whole])
    await wait_for(lambda: binder._waiting == 0)  # it stopped waiting
    packed = c.submit(small_step, 0, pure=False)
    await asyncio.wait_for(packed, 15)  # beside the held task: nothing claims the device
    await Event("let-go").set()
    assert await held == "held"
    await asyncio.sleep(0.5)
    assert await Variable("whole-ran").get() == "no"  # it never ran


@accelsched.gpu(memory="1GiB")
def sent_back_once(name: str) -> str:
    """Sends itself back the first time, as a worker whose device was withdrawn would."""
    from distributed import Reschedule, Variable

    seen = Variable(name)
    if seen.get(timeout=1) is None:
        seen.set("once")
        raise Reschedule()
    return "ran"


@pytest.mark.usefixtures("fake_gpus_2")
@gen_cluster(client=True, nthreads=[("127.0.0.1", 1, {"resources": {"GPU": 1}})], timeout=60)
async def test_a_worker_that_sent_a_task_back_is_judged_again(c, s, a):
    """A worker that sends a requirement task back leaves the task's class for a while
    (no bouncing), then is judged again: the task runs there (it stayed out for good,
    the only worker, until its devices were offered again)."""
    from distributed import Variable

    await accelsched.register(c, fast_restart=False)
    await wait_for(lambda: gpus(s, a.address) == 1)
    await Variable("sent-back").set(None)
    started = time.monotonic()
    assert await asyncio.wait_for(c.submit(sent_back_once, "sent-back", pure=False), 30) == "ran"
    assert time.monotonic() - started >= BENCH  # not bounced at once


@pytest.mark.usefixtures("fake_gpus_2")
@gen_cluster(client=True, nthreads=[("127.0.0.1", 1, {"resources": {"GPU": 1}})], timeout=60)
async def test_a_released_requirement_task_submitted_again_keeps_its_class(c, s, a):
    """An intermediate kept ``released`` (its dependent persisted) comes back with the next
    graph: it is not prepared twice (it erred as an invalid task, its class never went)."""
    await accelsched.register(c, fast_restart=False)
    await wait_for(lambda: gpus(s, a.address) == 1)
    first = dask.delayed(declared_step)(1, dask_key_name="declared-1")
    later = dask.delayed(lambda x: x + 1)(first, dask_key_name="later")
    persisted = c.persist(later)
    assert await c.compute(persisted) == 2
    assert await c.compute(first) == 1
    plugin = s.plugins[PLACEMENT_PLUGIN]
    del persisted
    await wait_for(lambda: not plugin.fallback.tasks)
    assert not plugin.fallback._classes
