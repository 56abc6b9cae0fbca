"""The worker's decisions as proposals, tested with numbers (no cluster), and the one actor
that carries them out, tested by the proposals it is given."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from accelsched.policy.leak import (
    Answer,
    DeviceHealth,
    LeakDecisions,
    Remeasured,
    Suspects,
    judge_answers,
)
from accelsched.policy.proposals import Proposal
from accelsched.worker import leak_check as acting
from accelsched.worker.leak_check import WorkerActor

T = 256  # the threshold, in bytes, of every device below


# --- which devices answered NVML ----------------------------------------------------------


def test_a_granted_device_that_stops_answering_is_withdrawn_once_without_a_restart() -> None:
    """A fault NVML shows now is not restarted into: the device is withdrawn, the worker
    kept, and it comes back in this process once it answers steadily."""
    h = DeviceHealth(streak=2)
    lost = Answer(1, "GPU-b", error="NVMLError_GpuIsLost(15)")
    assert judge_answers(h, [Answer(0, "GPU-a"), lost], recover=True) == [
        Proposal("withdraw", 1, "gpu-unhealthy", detail={"uuid": "GPU-b", "error": lost.error}),
    ]
    for _ in range(50):  # however long it fails: said once, and never a restart
        assert judge_answers(h, [Answer(0, "GPU-a"), lost], recover=True) == []
    # answers again: back after the streak, offered again
    assert judge_answers(h, [Answer(1, "GPU-b")], recover=True) == []
    assert judge_answers(h, [Answer(1, "GPU-b")], recover=True) == [
        Proposal("recover", 1, detail={"uuid": "GPU-b"})
    ]
    assert judge_answers(h, [Answer(1, "GPU-b")], recover=True) == []


def test_a_device_not_granted_is_not_withdrawn_and_without_recover_a_restart_takes_it_back() -> (
    None
):
    h = DeviceHealth(streak=2)
    other = Answer(0, "GPU-a", error="NVMLError_Unknown(999)", granted=False)
    assert judge_answers(h, [other], recover=True) == []
    assert 0 not in h.withdrawn  # not ours: no failure counted either
    failing = Answer(1, "GPU-b", error="lost")
    assert [p.action for p in judge_answers(h, [failing], recover=False)] == ["withdraw"]
    assert judge_answers(h, [failing], recover=False) == []  # failing: no restart into it
    # it answers: after the streak (2 answers), one restart request, into a device that answers
    assert judge_answers(h, [Answer(1, "GPU-b")], recover=False) == []
    assert judge_answers(h, [Answer(1, "GPU-b")], recover=False) == [
        Proposal("ask-restart", (1,), "gpu-unhealthy", {"nbytes": 0})
    ]
    for _ in range(10):  # answers on: still out of this process, asked once
        assert judge_answers(h, [Answer(1, "GPU-b")], recover=False) == []
    assert h.withdrawn == {1}
    # it fails again (the restart was deferred, say) and answers again: asked again
    assert judge_answers(h, [failing], recover=False) == []
    # still withdrawn, so no new failure counted: the same streak of 2 answers
    assert judge_answers(h, [Answer(1, "GPU-b")], recover=False) == []
    assert judge_answers(h, [Answer(1, "GPU-b")], recover=False) == [
        Proposal("ask-restart", (1,), "gpu-unhealthy", {"nbytes": 0})
    ]


def test_answers_are_judged_in_the_order_asked() -> None:
    answers = [Answer(2, "GPU-c", error="lost"), Answer(0, "GPU-a", error="lost")]
    proposals = judge_answers(DeviceHealth(), answers, recover=True)
    assert [(p.action, p.subject) for p in proposals] == [("withdraw", 2), ("withdraw", 0)]


# --- the leak estimates ---------------------------------------------------------------


def confirmed(d: LeakDecisions, estimates: dict[int, int], checks: int = 2) -> list[Proposal]:
    """``checks`` complete checks at ``estimates``: the last one's proposals."""
    proposals: list[Proposal] = []
    for _ in range(checks):
        verdicts = d.count({dev: (n, T) for dev, n in estimates.items()})
        proposals = d.propose(verdicts, complete=True)
    return proposals


def test_a_leak_confirmed_is_reclaimed_first_and_reported_when_it_came_back() -> None:
    d = LeakDecisions(confirmations=2)
    d.ran("train")
    assert confirmed(d, {0: 600}, checks=1) == []  # once above: not yet a leak
    assert confirmed(d, {0: 600}, checks=1) == [Proposal("reclaim", 0)]
    assert d.trying == [0]
    figures = {"nbytes": 600, "reclaimed": 500, "remaining": 100, "threshold": T}
    assert d.reclaimed({0: Remeasured(100, seconds=0.012345)}) == [
        Proposal(
            "report-reclaimed",
            0,
            figures={**figures, "seconds": 0.0123},
            detail={"prefixes": ("train",)},
        )
    ]
    assert d.trying == []
    assert confirmed(d, {0: 600}, checks=1) == []  # its count started again


def test_a_leak_still_held_is_reported_with_its_suspects_and_a_restart_asked() -> None:
    d = LeakDecisions(confirmations=2)
    d.ran("load")
    d.attribution.record("train", {0: 300})
    d.attribution.record("load", {0: 100, 1: 50})
    assert confirmed(d, {0: 600}) == [Proposal("reclaim", 0)]
    leak = Proposal(
        "report-leak",
        0,
        figures={"nbytes": 550, "threshold": T, "checks": 2, "unexplained": 150, "reclaimed": 50},
        detail={"prefixes": ("train", "load"), "attributed": (("train", 300), ("load", 100))},
    )
    restart = Proposal("ask-restart", (0,), "leak", {"nbytes": 550})
    assert d.reclaimed({0: Remeasured(550, seconds=0.01)}) == [leak, restart]
    # confirmed again while its restart waits: not tried again, not news, asked again
    assert confirmed(d, {0: 560}) == [Proposal("ask-restart", (0,), "leak", {"nbytes": 560})]
    # grown by a threshold: tried again
    assert confirmed(d, {0: 560 + T}) == [Proposal("reclaim", 0)]


def test_a_leak_no_measured_run_explains_blames_every_prefix_since_a_clean_check() -> None:
    d = LeakDecisions(confirmations=1, restart_on_leak=False)
    for prefix in ("z-step", "a-step"):
        d.ran(prefix)
    d.propose(d.count({0: (0, T)}), complete=False)  # clean but incomplete: kept
    d.ran("b-step")
    d.devices[0].tried(before=500, after=500, threshold=T)  # tried already: held
    (leak,) = d.propose(d.count({0: (500, T)}), complete=True)  # no restart asked
    assert leak.detail == {"prefixes": ("a-step", "b-step", "z-step"), "attributed": ()}
    assert leak.figures["unexplained"] == 500 and leak.figures["reclaimed"] == 0
    d.propose(d.count({0: (0, T)}), complete=True)  # clean and complete: forgotten
    d.ran("c-step")
    d.devices[1].tried(before=400, after=400, threshold=T)
    (leak,) = d.propose(d.count({1: (400, T)}), complete=True)
    assert leak.detail == {"prefixes": ("c-step",), "attributed": ()}


def test_a_step_every_run_of_which_left_nothing_is_never_blamed() -> None:
    """``keep`` ran twice and left nothing both times; ``leaky`` made the device's
    first context, so no run of it was measured: the leak blames ``leaky`` alone."""
    d = LeakDecisions(confirmations=1, restart_on_leak=False)
    for prefix in ("keep", "keep", "leaky"):
        d.ran(prefix)
    d.attribution.left_nothing("keep")
    d.attribution.left_nothing("keep")
    d.devices[0].tried(before=600, after=600, threshold=T)  # tried already: held
    (leak,) = d.propose(d.count({0: (600, T)}), complete=True)
    assert leak.detail == {"prefixes": ("leaky",), "attributed": ()}
    assert leak.figures["unexplained"] == 600


def test_one_run_not_seen_to_leave_nothing_keeps_a_step_a_suspect() -> None:
    d = LeakDecisions(confirmations=1, restart_on_leak=False)
    for prefix in ("keep", "keep", "other"):
        d.ran(prefix)
    d.attribution.left_nothing("keep")  # the second run was not measured (or grew)
    d.devices[0].tried(before=600, after=600, threshold=T)
    (leak,) = d.propose(d.count({0: (600, T)}), complete=True)
    assert leak.detail["prefixes"] == ("keep", "other")


def test_when_every_step_left_nothing_none_is_named() -> None:
    """A leak no step since the last clean check can have made names no suspect."""
    d = LeakDecisions(confirmations=1, restart_on_leak=False)
    d.ran("keep")
    d.attribution.left_nothing("keep")
    d.devices[0].tried(before=600, after=600, threshold=T)
    (leak,) = d.propose(d.count({0: (600, T)}), complete=True)
    assert leak.detail == {"prefixes": (), "attributed": ()}


def test_runs_seen_leaving_nothing_are_forgotten_at_a_clean_check() -> None:
    """After a clean, complete check, earlier clean runs excuse no later run."""
    d = LeakDecisions(confirmations=1, restart_on_leak=False)
    d.ran("keep")
    d.attribution.left_nothing("keep")
    assert d.propose(d.count({0: (0, T)}), complete=True) == []  # clean: forgotten
    d.ran("keep")  # this run was not seen to leave nothing
    d.devices[0].tried(before=600, after=600, threshold=T)
    (leak,) = d.propose(d.count({0: (600, T)}), complete=True)
    assert leak.detail["prefixes"] == ("keep",)


def test_a_reclaim_waits_for_the_gpu_tasks_in_their_threads() -> None:
    d = LeakDecisions(confirmations=1)
    asked: list[int] = []

    def executing() -> set[str]:
        asked.append(1)
        return running

    def propose(estimate: int) -> list[Proposal]:
        return d.propose(d.count({0: (estimate, T)}), complete=True, executing=executing)

    running = {"failed"}
    assert propose(600) == []  # neither reported nor restarted while it waits
    running = set()
    assert propose(600) == []  # gone: this check may be the transition that ends it
    assert propose(600) == [Proposal("reclaim", 0)]
    assert len(asked) == 3
    assert d.propose(d.count({0: (0, T)}), complete=True, executing=executing) == []
    assert len(asked) == 3  # nothing worth trying: the worker is not asked


def test_what_a_reclaim_measured_again_decides_per_device() -> None:
    d = LeakDecisions(confirmations=2)
    assert confirmed(d, {0: 600, 1: 700, 2: 800}) == [
        Proposal("reclaim", 0),
        Proposal("reclaim", 1),
        Proposal("reclaim", 2),
    ]
    # 0: NVML failed (held at the estimate that confirmed it); 1: a task took it (not
    # judged now); 2: still above
    proposals = d.reclaimed({0: Remeasured(None), 2: Remeasured(790, 0.5)})
    assert [(p.action, p.subject) for p in proposals] == [
        ("report-leak", 0),
        ("report-leak", 2),
        ("ask-restart", (0, 2)),
    ]
    assert proposals[0].figures["nbytes"] == 600 and proposals[0].figures["reclaimed"] == 0
    assert proposals[1].figures["nbytes"] == 790 and proposals[1].figures["reclaimed"] == 10
    assert proposals[2].figures["nbytes"] == 600 + 790
    assert d.reclaimed({}) == []  # heard already


def test_suspects_name_the_measured_runs_else_every_prefix() -> None:
    assert Suspects((("a", 2), ("b", 1)), ("x",)).prefixes == ("a", "b")
    assert Suspects((), ("x", "y")).prefixes == ("x", "y")


def test_a_proposal_refuses_an_unknown_action() -> None:
    with pytest.raises(ValueError):
        Proposal("explode", 0)  # type: ignore[arg-type]


# --- the one actor --------------------------------------------------------------------


@dataclass
class Device:
    index: int


@dataclass
class FakeInventory:
    """What the actor reaches of the inventory."""

    granted: list[Device] = field(default_factory=lambda: [Device(0), Device(1)])
    health: DeviceHealth = field(default_factory=lambda: DeviceHealth(streak=1))
    restarts: list[tuple[str, int]] = field(default_factory=list)

    @property
    def usable(self) -> list[int]:
        return [d.index for d in self.granted if d.index not in self.health.withdrawn]

    async def offer(self, on_usable: Callable[[list[int]], None]) -> list[int]:
        return []

    def ask_restart(self, reason: str, nbytes: int) -> None:
        self.restarts.append((reason, nbytes))


def actor_for(inv: FakeInventory) -> tuple[WorkerActor, list[Any]]:
    done: list[Any] = []
    actor = WorkerActor(
        inventory=inv,  # type: ignore[arg-type]
        set_devices=lambda usable: done.append(("devices", usable)),
        emit=lambda action, **fields: done.append((action, fields)),
        spawn=lambda fn, *args: done.append(("spawn", fn.__name__)),
    )
    return actor, done


def test_the_actor_withdraws_and_offers_again_saying_so() -> None:
    inv = FakeInventory()
    actor, done = actor_for(inv)
    error = "NVMLError_GpuIsLost(15)"
    actor.apply(judge_answers(inv.health, [Answer(1, "GPU-b", error)], recover=True))
    assert done == [
        ("gpu-unhealthy", {"device": 1, "uuid": "GPU-b", "error": error}),
        ("devices", [0]),
        ("spawn", "offer"),
    ]
    assert inv.health.withdrawn == {1} and inv.restarts == []  # no restart into the fault
    done.clear()
    proposals = judge_answers(inv.health, [Answer(1, "GPU-b")], recover=True)
    assert proposals == [Proposal("recover", 1, detail={"uuid": "GPU-b"})]
    actor.apply(proposals)
    assert done == [
        ("gpu-recovered", {"device": 1, "uuid": "GPU-b"}),
        ("devices", [0, 1]),
        ("spawn", "offer"),
    ]
    assert inv.health.withdrawn == set()


def test_the_actor_reports_leaks_with_the_events_fields_in_order(monkeypatch: Any) -> None:
    inv = FakeInventory()
    actor, done = actor_for(inv)
    collections: list[list[int]] = []
    monkeypatch.setattr(acting, "reclaim", lambda devs: collections.append(devs))
    d = LeakDecisions(confirmations=1)
    d.attribution.record("train", {0: 300, 1: 100})
    actor.apply(d.propose(d.count({0: (600, T), 1: (900, T)}), complete=True))
    assert collections == [[0, 1]]  # one collection for both devices
    actor.apply(d.reclaimed({0: Remeasured(100, 0.25), 1: Remeasured(800, 0.5)}))
    assert done == [
        (
            "leak-reclaimed",
            {
                "device": 0,
                "nbytes": 600,
                "reclaimed": 500,
                "remaining": 100,
                "threshold": T,
                "prefixes": ["train"],
                "seconds": 0.25,
            },
        ),
        (
            "leak",
            {
                "device": 1,
                "nbytes": 800,
                "threshold": T,
                "checks": 1,
                "prefixes": ["train"],
                "attributed": {"train": 100},
                "unexplained": 700,
                "reclaimed": 100,
            },
        ),
    ]
    assert [list(fields) for _, fields in done] == [  # the order docs/events.md gives
        ["device", "nbytes", "reclaimed", "remaining", "threshold", "prefixes", "seconds"],
        [
            "device",
            "nbytes",
            "threshold",
            "checks",
            "prefixes",
            "attributed",
            "unexplained",
            "reclaimed",
        ],
    ]
    assert inv.restarts == [("leak", 800)]


def test_the_actor_refuses_the_schedulers_actions() -> None:
    actor, _ = actor_for(FakeInventory())
    with pytest.raises(ValueError, match="fall-back"):
        actor.apply([Proposal("fall-back", "key")])
