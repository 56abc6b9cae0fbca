"""What a leak check proposes from its estimates: decisions only, no distributed import.

A check estimates each device it can judge (:func:`~accelsched.policy.leak.estimate`);
:class:`LeakDecisions` counts those estimates against their thresholds, names the
suspects, and proposes what to do, as :class:`~accelsched.policy.proposals.Proposal`
objects the worker's one actor carries out. A confirmed leak is first *reclaimed*
(garbage collected, pools freed) where :class:`~accelsched.policy.leak.Reclaims` finds
it worth a try; only the devices measured again after that try (:meth:`reclaimed`)
decide between ``report-reclaimed`` and a ``report-leak`` with a restart request.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from accelsched.policy.leak import Attribution, LeakDetector, LeakReports, Reclaims, Verdict
from accelsched.policy.proposals import Proposal

__all__ = ["LeakDecisions", "Remeasured", "Suspects"]


@dataclass(frozen=True)
class Suspects:
    """Whom a leak on one device blames.

    ``ranked``: the steps or task prefixes whose measured runs left memory behind on the
    device since the last clean check, with those bytes, most first. When none did,
    ``blamed``: every task prefix that ran on the worker since then, by name, less those
    every run of which was seen to leave nothing (never an innocent step: with none
    left, no suspect at all).
    """

    ranked: tuple[tuple[str, int], ...] = ()
    blamed: tuple[str, ...] = ()

    @property
    def prefixes(self) -> tuple[str, ...]:
        return tuple(p for p, _ in self.ranked) or self.blamed


@dataclass(frozen=True)
class Remeasured:
    """A device's estimate measured again after a reclaim."""

    estimate: int | None  # None: NVML did not answer (the next check withdraws it)
    seconds: float = 0.0  # collecting, freeing and measuring again


@dataclass
class _Round:
    """A reclaim proposed: the leaks it concerns, until their devices are measured again."""

    held: list[Verdict]  # confirmed, not tried: a restart is asked for them
    tried: list[Verdict]
    suspects: dict[int, Suspects]


@dataclass
class LeakDecisions:
    """What a leak check remembers between checks, and what it proposes at each.

    ``restart_on_leak``: a leak still held after its reclaim asks for a restart.
    """

    confirmations: int = 2
    restart_on_leak: bool = True
    reports: LeakReports = field(default_factory=LeakReports)
    reclaims: Reclaims = field(default_factory=Reclaims)
    attribution: Attribution = field(default_factory=Attribution)
    detector: LeakDetector = field(init=False)
    _round: _Round | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.detector = LeakDetector(self.confirmations)

    def ran(self, prefix: str) -> None:
        """A task of ``prefix`` started: a suspect until the next clean check."""
        self.detector.ran(prefix)

    @property
    def trying(self) -> list[int]:
        """The devices a reclaim was proposed for, until :meth:`reclaimed` hears of them."""
        return [] if self._round is None else [v.device for v in self._round.tried]

    def count(self, estimates: Mapping[int, tuple[int, int]]) -> list[Verdict]:
        """One verdict per device judged: ``estimates`` is device -> (estimate,
        threshold), in the order judged. A device at or under its threshold ends any
        wait for a reclaim there."""
        verdicts = []
        for device, (estimate, threshold) in estimates.items():
            verdict = self.detector.check(device, estimate, threshold)
            verdicts.append(verdict)
            if verdict.above == 0:
                self.reclaims.forget(device)
        return verdicts

    def propose(
        self,
        verdicts: list[Verdict],
        *,
        complete: bool,
        executing: Callable[[], Iterable[Any]] = set,
    ) -> list[Proposal]:
        """What this check's ``verdicts`` call for.

        ``complete``: no device was skipped for a running GPU task; such a check with
        every device at or under its threshold is clean, and the suspects are forgotten.
        ``executing`` gives the GPU tasks in their threads now, asked only when a reclaim
        is worth trying (it waits for them). Proposes ``reclaim`` for the leaks to try
        (then :meth:`reclaimed` decides, once measured again), else the leaks' reports
        and restart request.
        """
        innocent = self.attribution.innocent(self.detector.runs())
        ran = self.detector.end_check(verdicts, complete=complete)
        blamed = tuple(p for p in ran if p not in innocent)
        clean = complete and all(v.above == 0 for v in verdicts)
        ranked = self.attribution.take([v.device for v in verdicts], clear=clean)
        suspects = {v.device: Suspects(tuple(ranked[v.device]), blamed) for v in verdicts}
        leaks = [v for v in verdicts if v.leak]
        worth = [v for v in leaks if self.reclaims.worth_trying(v.device, v.estimate, v.threshold)]
        running = set(executing()) if worth else set()
        tried = [v for v in worth if self.reclaims.settled(v.device, running)]
        held = [v for v in leaks if v not in worth]
        if tried:
            self._round = _Round(held, tried, suspects)
            return [Proposal("reclaim", v.device) for v in tried]
        self._round = None
        return self._conclude(held, {}, suspects)

    def reclaimed(self, after: Mapping[int, Remeasured]) -> list[Proposal]:
        """What the reclaim proposed last decided, given its devices measured again.

        A device missing from ``after`` was taken by a GPU task meanwhile: not judged now
        (the check runs again when the task ends). One back at or under its threshold is
        reported as reclaimed and its count starts again; one still above is a leak, at
        its new estimate, and so is one NVML did not answer, at the estimate before.
        """
        pending, self._round = self._round, None
        if pending is None:
            return []
        held = list(pending.held)
        came_back: dict[int, int] = {}
        out: list[Proposal] = []
        for v in pending.tried:
            again = after.get(v.device)
            if again is None:
                continue
            if again.estimate is None:
                held.append(v)
                continue
            outcome = self.reclaims.outcome(v.device, v.estimate, again.estimate, v.threshold)
            came_back[v.device] = outcome.reclaimed
            if not outcome.ended:
                held.append(replace(v, estimate=again.estimate))
                continue
            self.detector.reset(v.device)
            figures = {
                "nbytes": v.estimate,
                "reclaimed": outcome.reclaimed,
                "remaining": again.estimate,
                "threshold": v.threshold,
                "seconds": round(again.seconds, 4),
            }
            prefixes = pending.suspects[v.device].prefixes
            out.append(
                Proposal(
                    "report-reclaimed", v.device, figures=figures, detail={"prefixes": prefixes}
                )
            )
        return out + self._conclude(held, came_back, pending.suspects)

    def _conclude(
        self, held: list[Verdict], came_back: dict[int, int], suspects: dict[int, Suspects]
    ) -> list[Proposal]:
        """Report the held leaks that are news; one restart request for them all (asked
        again at each confirmation: a deferred restart happens once its obstacle goes)."""
        if not held:
            return []
        out: list[Proposal] = []
        for v in held:
            if not self.reports.is_news(v):
                continue
            s = suspects[v.device]
            explained = sum(n for _, n in s.ranked)
            figures = {
                "nbytes": v.estimate,
                "threshold": v.threshold,
                "checks": v.above,
                "unexplained": max(0, v.estimate - explained),
                "reclaimed": came_back.get(v.device, 0),
            }
            detail = {"prefixes": s.prefixes, "attributed": s.ranked}
            out.append(Proposal("report-leak", v.device, figures=figures, detail=detail))
        self.detector.reset()
        if self.restart_on_leak:
            nbytes = sum(v.estimate for v in held)
            devices = tuple(v.device for v in held)
            out.append(Proposal("ask-restart", devices, "leak", {"nbytes": nbytes}))
        return out
