"""The decisions the plugins carry out, tested with numbers (no cluster)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from accelsched import internals
from accelsched.devices import MemoryReading
from accelsched.policy.leak import LeakDecisions, Use, classify
from accelsched.policy.proposals import Proposal
from accelsched.policy.requests import RestartBudget, admit_restart, keeps_devices, restart_reply
from accelsched.policy.timeouts import (
    CHAIN,
    MAX_GPUS,
    NO_GPU_CAPACITY,
    TIMEOUT,
    UNSATISFIABLE,
    Deadlines,
    Waiting,
    deadline,
    summarise,
    sweep,
)
from accelsched.scheduler.placement_plugin import PlacementPlugin

# --- which tasks fall back now, and when to look again --------------------------------


class Due(dict):  # type: ignore[type-arg]
    """Each waiting task's deadline, as the scheduler's task records hold it."""

    def add(self, d: Deadlines, key: object, at: float) -> None:
        self[key] = at
        d.add(key, at)  # type: ignore[arg-type]

    def pop_due(self, d: Deadlines, now: float) -> list[object]:
        due = d.pop_due(now)
        for key in due:  # looked at: no longer due (as a check does)
            del self[key]
        return due


def deadlines() -> tuple[Deadlines, Due]:
    due = Due()
    return Deadlines(lambda key, at: due.get(key) == at), due


def test_deadlines_pop_only_what_is_due_in_order() -> None:
    d, due = deadlines()
    due.add(d, "a", 5.0)
    due.add(d, "b", 2.0)
    due.add(d, "c", 9.0)
    assert len(due) == 3 and d.next_deadline() == 2.0
    assert due.pop_due(d, 1.9) == []
    assert due.pop_due(d, 5.0) == ["b", "a"]
    assert d.next_deadline() == 9.0 and "c" in due and "a" not in due


def test_deadlines_skip_tasks_that_left_and_keep_the_newest_entry() -> None:
    d, due = deadlines()
    due.add(d, "placed", 1.0)
    del due["placed"]  # placed before its deadline
    due.add(d, "again", 1.0)
    del due["again"]
    due.add(d, "again", 4.0)  # unrunnable again: only this entry counts
    assert d.next_deadline() == 4.0
    assert due.pop_due(d, 10.0) == ["again"]
    assert d.next_deadline() is None and len(due) == 0


def test_deadlines_memory_stays_with_what_waits() -> None:
    d, due = deadlines()
    for i in range(10_000):
        due.add(d, i, 100.0 + i)
        del due[i]  # placed at once: every entry stale
    due.add(d, "last", 1.0)
    assert due.pop_due(d, 1.0) == ["last"]
    assert len(d._heap) <= 64  # compacted: stale entries do not pile up


def test_one_deadline_rule_for_entering_and_for_a_task_kept_waiting() -> None:
    assert deadline(Waiting("strict", since=3.0, amount=1, timeout=None)) is None
    assert deadline(Waiting("t", since=3.0, amount=1, timeout=5.0)) == 8.0
    # waiting cannot help, or a predecessor fell back: looked at at once ...
    assert deadline(Waiting("huge", since=3.0, amount=MAX_GPUS + 1, timeout=5.0)) == 3.0
    chained = Waiting("chained", since=3.0, amount=1, timeout=5.0, predecessor_fell_back=True)
    assert deadline(chained) == 3.0
    # ... and once kept waiting (GPUs there now), at its own timeout
    assert sweep([chained], now=3.0, largest=1) == ([], {"chained": 8.0})


def fall_back(key: str, reason: str, waited: float) -> Proposal:
    return Proposal("fall-back", key, reason, {"waited": waited})


def test_a_burst_of_fallbacks_is_one_event() -> None:
    few = [fall_back(f"k{i}", TIMEOUT, 1.0 + i) for i in range(3)]
    assert summarise(few, detail=10) == [
        {"key": "k0", "waited": 1.0, "reason": TIMEOUT, "count": 1},
        {"key": "k1", "waited": 2.0, "reason": TIMEOUT, "count": 1},
        {"key": "k2", "waited": 3.0, "reason": TIMEOUT, "count": 1},
    ]
    burst = [fall_back(f"k{i}", NO_GPU_CAPACITY if i % 4 else CHAIN, float(i)) for i in range(100)]
    (event,) = summarise(burst, detail=10)
    assert event["count"] == 100 and "key" not in event
    assert event["keys"] == [f"k{i}" for i in range(10)]
    assert event["reasons"] == {NO_GPU_CAPACITY: 75, CHAIN: 25}
    assert event["reason"] == NO_GPU_CAPACITY
    assert event["waited"] == 50.0 and event["waited_max"] == 99.0


def test_sweep_falls_back_what_is_due_and_wakes_at_the_next_deadline() -> None:
    waiting = [
        Waiting("due", since=0.0, amount=1, timeout=5.0),  # waited 10 s of 5
        Waiting("later", since=8.0, amount=1, timeout=5.0),  # deadline 13
        Waiting("soon", since=9.0, amount=1, timeout=2.0),  # deadline 11
        Waiting("strict", since=0.0, amount=1, timeout=None),  # never
    ]
    proposals, later = sweep(waiting, now=10.0, largest=0)
    assert proposals == [Proposal("fall-back", "due", TIMEOUT, {"waited": 10.0})]
    assert later == {"later": 13.0, "soon": 11.0} and min(later.values()) == 11.0


def test_sweep_zero_timeout_and_chains_depend_on_capacity() -> None:
    waiting = [
        Waiting("zero", since=3.0, amount=1, timeout=0.0),
        Waiting("chained", since=3.0, amount=2, timeout=60.0, predecessor_fell_back=True),
    ]
    proposals, later = sweep(waiting, now=3.0, largest=1)
    assert proposals == [fall_back("zero", NO_GPU_CAPACITY, 0.0), fall_back("chained", CHAIN, 0.0)]
    assert later == {}
    proposals, later = sweep(waiting[1:], now=3.0, largest=2)  # a 2-GPU worker
    assert proposals == [] and later == {"chained": 63.0}


def test_sweep_an_amount_no_worker_can_ever_offer_falls_back_at_once() -> None:
    waiting = [
        Waiting("huge", since=3.0, amount=2**64, timeout=60.0),
        Waiting("edge", since=3.0, amount=MAX_GPUS, timeout=60.0),
        Waiting("strict", since=3.0, amount=MAX_GPUS + 1, timeout=None),
    ]
    proposals, later = sweep(waiting, now=3.5, largest=2**70)  # whatever workers say
    assert proposals == [fall_back("huge", UNSATISFIABLE, 0.5)]
    assert proposals[0].figures["waited"] == 0.5
    assert later == {"edge": 63.0}  # "edge" waits its timeout; "strict" errs elsewhere


def test_sweep_of_nothing_sets_no_timer() -> None:
    assert sweep([], now=0.0, largest=0) == ([], {})


# --- restart admission ------------------------------------------------------------------


def admit(budget: RestartBudget, now: float = 0.0, **facts: bool) -> Proposal | None:
    return admit_restart(
        budget,
        "nanny-a",
        now,
        worker="tcp://a",
        why="leak",
        **{"has_nanny": True, "has_peer": True, **facts},
    )


def test_admission_refuses_strangers_and_defers_what_would_lose_data() -> None:
    budget = RestartBudget(max_restarts=3, window=60.0)
    # a stranger's request is refused before admission (Requests), and told so
    assert restart_reply(None, authentic=False) == {"status": "refused"}
    a = admit(budget, has_nanny=False)
    assert a == Proposal("defer", "tcp://a", "no-nanny")
    assert restart_reply(a) == {"status": "deferred", "reason": "no-nanny"}
    a = admit(budget, has_peer=False)
    assert a == Proposal("defer", "tcp://a", "no-peer")
    assert restart_reply(a) == {"status": "deferred", "reason": "no-peer"}
    assert budget.in_flight == frozenset()  # none of them took budget


def test_a_budget_replacing_another_counts_the_restarts_it_took() -> None:
    """A placement plugin registered again (to change an option) takes over the restarts
    its predecessor took and those under way: a worker past the new budget is not
    restarted again, nor one its predecessor is restarting."""
    before = RestartBudget(max_restarts=2, window=60.0)
    assert before.request("nanny-a", 0.0) is None
    before.done("nanny-a")
    after = before.held_to(RestartBudget(max_restarts=1, window=60.0))
    assert after.request("nanny-a", 1.0) == "budget"
    assert RestartBudget(max_restarts=1, window=60.0).request("nanny-a", 1.0) is None
    # one under way when it was replaced ends on the old budget: one record for both
    assert before.request("nanny-b", 2.0) is None
    assert after.request("nanny-b", 3.0) == "in-flight"
    before.done("nanny-b")
    assert after.in_flight == frozenset() and after.request("nanny-b", 4.0) == "budget"
    assert after.request("nanny-a", 61.0) is None  # out of the window: allowed again


def test_admission_counts_the_budget() -> None:
    budget = RestartBudget(max_restarts=2, window=60.0, max_concurrent=1)
    first = admit(budget, now=0.0)
    assert first == Proposal("restart", "tcp://a", "leak")  # reason: what its event says
    assert restart_reply(first) == {"status": "accepted"}
    assert budget.in_flight == frozenset({"nanny-a"})  # keyed by its nanny
    again = admit(budget, now=1.0)
    assert again is None and restart_reply(again) == {"status": "in-flight"}
    budget.done("nanny-a")
    assert admit(budget, now=2.0) == Proposal("restart", "tcp://a", "leak")
    budget.done("nanny-a")
    over = admit(budget, now=3.0)  # a third within 60 s
    assert over == Proposal("quarantine", "tcp://a", "budget")
    assert restart_reply(over) == {"status": "deferred", "reason": "budget"}
    assert budget.in_flight == frozenset()  # a refusal takes no budget
    restarted = admit(budget, now=61.0)  # the first left the window
    assert restarted is not None and restarted.action == "restart"


def test_admission_defers_on_concurrency() -> None:
    budget = RestartBudget(max_restarts=5, window=60.0, max_concurrent=1)
    assert budget.request("nanny-b", 0.0) is None
    a = admit(budget)
    assert a == Proposal("defer", "tcp://a", "concurrency")
    assert restart_reply(a) == {"status": "deferred", "reason": "concurrency"}


def test_a_restart_for_a_failed_device_carries_its_reason_and_keeps_the_others() -> None:
    budget = RestartBudget(max_restarts=1, window=60.0)
    unhealthy = admit_restart(
        budget,
        "nanny-a",
        0.0,
        worker="tcp://a",
        why="gpu-unhealthy",
        has_nanny=True,
        has_peer=True,
    )
    assert unhealthy == Proposal("restart", "tcp://a", "gpu-unhealthy")
    assert keeps_devices("gpu-unhealthy")  # its failed device is withdrawn already
    assert not keeps_devices("leak")  # a leaking worker takes no GPU task meanwhile


class Recorder:
    """Stands in for the parts the actor acts through: records each call."""

    def __init__(self) -> None:
        self.calls: list[tuple[object, ...]] = []
        self.released: set[str] = set()  # tasks no longer unrunnable

    def still_unrunnable(self, key: str) -> bool:
        return key not in self.released

    def fall_back(self, proposals: list[Proposal]) -> None:
        self.calls.append(("fall_back", [p.subject for p in proposals]))

    def fail_task(self, scheduler: object, key: str, exc: Exception, stimulus_id: str) -> None:
        self.calls.append(("err", key, str(exc)))

    def spawn(self, scheduler: object, fn: object, ws: Any, budget_key: str, why: str) -> None:
        self.calls.append(("begin", ws.address, budget_key, why))

    def emit(self, action: str, worker: str, **figures: object) -> None:
        self.calls.append((action, worker, figures["reason"]))

    def quarantine(self, worker: str, reason: str) -> None:
        self.calls.append(("quarantine", worker, reason))


def test_the_actor_carries_out_each_proposal_through_its_part(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    parts = Recorder()
    actor = PlacementPlugin()  # the scheduler's one actor, its parts a recorder
    actor.fallback = parts  # type: ignore[assignment]
    workers = {w: SimpleNamespace(address=w, nanny=f"{w}-nanny") for w in ("tcp://a", "tcp://b")}
    actor.scheduler = SimpleNamespace(workers=workers)  # type: ignore[assignment]
    actor.deferred = {}
    # its own steps and distributed's, recorded: what each proposal leads to, in order
    monkeypatch.setattr(internals, "fail_task", parts.fail_task)
    monkeypatch.setattr(internals, "spawn", parts.spawn)
    actor._emit = parts.emit  # type: ignore[method-assign]
    actor.quarantine = parts.quarantine  # type: ignore[method-assign]
    actor.act(
        [
            fall_back("x", TIMEOUT, 5.0),
            Proposal("err", "bad", "invalid resources"),
            Proposal("restart", "tcp://a", "leak"),
            fall_back("y", CHAIN, 0.0),
            Proposal("defer", "tcp://b", "no-peer"),
            Proposal("quarantine", "tcp://c", "budget"),
        ]
    )
    assert parts.calls == [
        ("err", "bad", "task 'bad': invalid resources"),
        ("begin", "tcp://a", "tcp://a-nanny", "leak"),  # its budget: its nanny's
        ("restart-deferred", "tcp://b", "no-peer"),  # deferred, and quarantined
        ("quarantine", "tcp://b", "restart-deferred: no-peer"),
        ("quarantine", "tcp://c", "restart-budget"),
        ("fall_back", ["x", "y"]),  # one check's fallbacks together, after the rest
    ]
    parts.calls.clear()
    actor.deferred.clear()  # the deferral is news again
    keep = [Proposal("defer", "tcp://b", "no-peer"), Proposal("quarantine", "tcp://c", "budget")]
    actor.act(keep, keep_devices=True)  # asked because a device failed
    assert parts.calls == [("restart-deferred", "tcp://b", "no-peer")]  # no quarantine
    with pytest.raises(ValueError, match="not a scheduler action"):
        actor.act([Proposal("withdraw", 0)])
    actor.act([])
    assert len(parts.calls) == 1  # nothing proposed, nothing done
    parts.released.add("gone")  # released by an action before it (its dependents erred)
    actor.act([Proposal("err", "gone", "invalid resources")])
    assert len(parts.calls) == 1  # nobody waits for it: not erred


# --- de-duplication of leak reports -------------------------------------------------------


def test_a_leak_is_reported_once_and_again_only_when_it_grew_by_a_threshold() -> None:
    d = LeakDecisions()
    assert d.devices[0].is_news(150, 100)
    assert not d.devices[0].is_news(150, 100)
    assert not d.devices[0].is_news(249, 100)  # grew by 99 < 100
    assert d.devices[0].is_news(250, 100)
    assert d.devices[1].is_news(150, 100)  # another device is another leak
    assert not d.devices[0].is_news(300, 100)


# --- reclaim before restart ---------------------------------------------------------------


def test_a_reclaim_that_brings_the_estimate_under_the_threshold_ends_the_leak() -> None:
    device = LeakDecisions().devices[0]
    assert device.worth_trying(600, 256)
    assert device.tried(before=600, after=0, threshold=256) == (600, True)  # (reclaimed, ended)
    at = device.tried(before=600, after=256, threshold=256)  # at the threshold: ends
    assert at == (344, True)
    assert device.worth_trying(600, 256)  # an ended leak leaves no memory of a try


def test_a_leak_still_held_is_not_tried_again_until_it_grew_by_a_threshold() -> None:
    d = LeakDecisions()
    held = d.devices[0].tried(before=600, after=550, threshold=256)
    assert held == (50, False)
    assert not d.devices[0].worth_trying(550, 256)  # confirmed again while its restart waits
    assert not d.devices[0].worth_trying(805, 256)  # grew by 255 < 256
    assert d.devices[0].worth_trying(806, 256)
    assert d.devices[1].worth_trying(550, 256)  # another device: its own leak
    grew = d.devices[0].tried(before=900, after=1000, threshold=256)  # grew meanwhile
    assert grew == (0, False)
    assert d.devices[0].tried(before=1000, after=100, threshold=256)[1]
    assert d.devices[0].worth_trying(550, 256)


def test_a_try_waits_for_the_gpu_tasks_in_threads_at_the_confirmation_and_one_check() -> None:
    d = LeakDecisions()
    wait = d.max_wait
    assert d.devices[0].settled(set(), wait)  # nothing in a thread: try at once
    assert not d.devices[1].settled({"failed"}, wait)  # a failed task's thread may hold it
    assert not d.devices[1].settled({"failed", "next"}, wait)  # still in its thread
    assert not d.devices[1].settled({"next"}, wait)  # gone: this check may be its transition
    assert d.devices[1].settled({"next", "later"}, wait)  # tasks started since do not count
    assert not d.devices[1].tried(before=600, after=600, threshold=256)[1]
    assert not d.devices[1].settled({"again"}, wait)  # a new confirmation waits anew


def test_a_try_waits_for_at_most_max_wait_checks() -> None:
    d = LeakDecisions(max_wait=3)
    assert not d.devices[0].settled({"long"}, d.max_wait)
    assert not d.devices[0].settled({"long"}, d.max_wait)
    assert not d.devices[0].settled({"long"}, d.max_wait)
    assert d.devices[0].settled(
        {"long"}, d.max_wait
    )  # a task running for hours holds no restart back
    d.count({0: (0, 256)})  # the device went clean meanwhile: the wait is over
    assert not d.devices[0].settled({"other"}, d.max_wait)


# --- classification of unrequested GPU use ------------------------------------------------


def r(nbytes: int, exact: bool = True, context: bool | None = True) -> MemoryReading:
    return MemoryReading(nbytes, exact, context)


@pytest.mark.parametrize(
    "before, after, expected",
    [
        ({0: r(100)}, {0: r(100)}, []),  # nothing happened
        ({0: r(100)}, {0: r(612)}, [Use(0, 512, False)]),  # grew
        ({0: r(0, context=False)}, {0: r(0)}, [Use(0, 0, True)]),  # made a context only
        ({0: r(612)}, {0: r(100)}, []),  # shrank: freed, not used
        ({0: r(100, exact=False)}, {0: r(900, exact=False)}, []),  # device-wide figures
        ({0: r(100)}, {0: r(900, exact=False)}, []),  # one side not this process's own
        ({0: r(0, context=None)}, {0: r(0)}, []),  # could not tell before: no context claim
        ({0: r(0), 1: r(0)}, {0: r(0), 1: r(64)}, [Use(1, 64, False)]),
        ({}, {0: r(64)}, []),  # no reading before: nothing to compare
    ],
)
def test_classify(before, after, expected) -> None:  # type: ignore[no-untyped-def]
    assert classify(before, after) == expected


# --- option and declaration parsing ----------------------------------------------------


@pytest.mark.parametrize(
    "value", ["", " ", "s", ".", "1e400s", 10**400, float("nan"), float("inf"), "-5s", "inf"]
)
def test_durations_that_are_no_duration_name_the_option(value: object) -> None:
    from accelsched.config import parse_optional_duration

    with pytest.raises(ValueError, match=r"invalid fallback_timeout="):
        parse_optional_duration("fallback_timeout", value)


@pytest.mark.parametrize(
    "value, seconds", [(".5s", 0.5), ("+2s", 2.0), ("1.5min", 90.0), ("250ms", 0.25), (0, 0.0)]
)
def test_durations(value: object, seconds: float) -> None:
    from accelsched.config import parse_optional_duration

    assert parse_optional_duration("x", value) == seconds


@pytest.mark.parametrize("value", ["1us", "5ms", 0.001])
def test_intervals_have_a_floor(value: object) -> None:
    from accelsched.config import parse_interval

    with pytest.raises(ValueError, match=r"at least 10ms"):
        parse_interval("check_interval", value)


@pytest.mark.parametrize(
    "value",
    # (a float of 2**63 bytes or more: no heartbeat carries it, and the worker closed)
    ["", "GiB", float("inf"), float("nan"), "1e400", 10**400, 0, 1e30, "1.0e30", 2.0**63, 1e19],
)
def test_thresholds_that_are_no_size_name_the_option(value: object) -> None:
    from accelsched.config import parse_threshold

    with pytest.raises(ValueError, match=r"invalid leak_threshold="):
        parse_threshold("leak_threshold", value)


def test_a_size_is_whole_bytes_with_a_number() -> None:
    """What a size string says, read by dask and checked: whole bytes, or None where dask
    would read one of the unit ("GiB") or drop a fraction of a byte ("1.5e0")."""
    from accelsched.config import parse_size, size_bytes

    said = {"24GiB": 24 << 30, "1.5GiB": 3 << 29, "2.5 kB": 2500, " 512 ": 512, "1e3": 1000}
    # read exactly, not as dask's floats (8.2 * 1e9 is 8199999999.999999 there)
    said |= {"8.2GB": 8_200_000_000, "4.1MB": 4_100_000, "9007199254740993": 2**53 + 1}
    assert {text: size_bytes(text) for text in said} == said
    for text in ["", " ", "GiB", "MiB", "1.5", "1.5e0", "1.5B", "1e-1", "1e400", "nan", "5 5"]:
        assert size_bytes(text) is None, text
        with pytest.raises(ValueError, match=f"invalid free_pools_min={text!r}"):
            parse_size("free_pools_min", text)


@pytest.mark.parametrize(
    "declared, reason",
    [
        ("two", "invalid-declaration: 'two'"),
        (float("nan"), "invalid-declaration: nan"),
        (-1, "invalid-declaration: -1"),
        (True, "invalid-declaration: True"),
    ],
)
def test_declarations_that_are_no_count_claim_nothing(declared: object, reason: str) -> None:
    from accelsched.policy.requests import Claim, decide_claim, declared_count

    assert decide_claim(declared, 2, advertise_undeclared=True) == Claim(0, reason)
    assert declared_count(declared) is None


@pytest.mark.parametrize("amount", [0, -1, float("nan"), float("inf"), "1", True, None])
def test_odd_gpu_amounts_are_invalid(amount: object) -> None:
    from accelsched.policy.requirements import invalid_amount

    assert "expected a positive, finite number of GPUs" in (invalid_amount(amount) or "")


@pytest.mark.parametrize("amount", [1, 2, 0.5, 0.25])
def test_gpu_amounts(amount: float) -> None:
    from accelsched.policy.requirements import invalid_amount

    assert invalid_amount(amount) is None


# --- when a failing GPU is healthy again ------------------------------------------------


def test_a_device_comes_back_after_a_streak_that_doubles_with_each_failure() -> None:
    from accelsched.policy.leak import DeviceHealth

    h = DeviceHealth(streak=3, ceiling=10)
    assert not h.answered(0)  # healthy: nothing to bring back
    assert h.failed(0) and not h.failed(0)  # withdrawn once, said once
    assert [h.answered(0) for _ in range(3)] == [False, False, True]
    assert h.failed(0) and h.needed(0) == 6
    assert [h.answered(0) for _ in range(5)] == [False] * 5
    assert not h.failed(0)  # a failure mid-streak: still out, streak starts over
    assert [h.answered(0) for _ in range(6)] == [False] * 5 + [True]
    h.failed(0)
    assert h.needed(0) == 10  # the ceiling
    assert h.failed(1) and h.needed(1) == 3  # devices apart
    with pytest.raises(ValueError):
        DeviceHealth(streak=0)


def test_a_device_left_out_is_probed_with_backoff_and_back_when_steady() -> None:
    from accelsched.policy.leak import DeviceHealth

    p = DeviceHealth(streak=3, first=1.0, longest=8.0)
    p.left_out(0, now=0.0)
    p.left_out(2, now=0.0)
    assert p.waiting == [0, 2] and p.due(0.5) == [] and p.due(1.0) == [0, 2]
    # device 0 stays dead: asked 1 s after, then waits of 2, 4, 8 and 8 s (the ceiling)
    assert p.probe_answered(2, 1.0) is False  # device 2 answers: its streak begins
    for at, then in [(1.0, 3.0), (3.0, 7.0), (7.0, 15.0), (15.0, 23.0)]:
        assert 0 in p.due(at)
        p.retry(0, at)
        assert 0 not in p.due(then - 0.01) and 0 in p.due(then)
    # device 2 answers: back after the streak, probed at the first pace meanwhile
    assert p.due(1.5) == [] and p.due(2.0) == [2]  # at the first pace while it answers
    assert [p.probe_answered(2, t) for t in (2.0, 3.0)] == [False, True]
    # back: reported at once, again 1 s and 2 s after each report not granted
    assert p.waiting == [0, 2] and p.due(3.0) == [2] and 2 not in p.withdrawn
    assert not p.probe_answered(2, 4.0)  # back already: nothing more to say
    assert p.retry(2, 3.0) == 1.0 and p.due(3.9) == [] and p.due(4.0) == [2]
    assert p.retry(2, 4.0) == 2.0 and p.due(6.0) == [2] and 2 not in p.withdrawn
    p.granted(2)
    assert p.waiting == [0]
    # device 0 flaps: a failure mid-streak starts it over, and the wait keeps doubling
    assert not p.probe_answered(0, 31.0) and not p.probe_answered(0, 32.0)
    p.retry(0, 33.0)
    assert p.due(40.9) == [] and p.due(41.0) == [0]  # 8 s: the ceiling
    assert [p.probe_answered(0, 41.0 + t) for t in range(3)] == [False, False, True]
    assert p.due(43.0) == [0]  # back: to be reported
    p.granted(0)
    assert p.waiting == [] and p.due(1e9) == []
    assert p.retry(0, 50.0) == 0.0  # not on probation: nothing to schedule
    assert p.waiting == []
    with pytest.raises(ValueError):
        DeviceHealth(first=0.0)
    with pytest.raises(ValueError):
        DeviceHealth(first=2.0, longest=1.0)
