"""How many guard restarts to allow: decisions only, no distributed import.

A worker that leaks on every task would otherwise be restarted in a loop, and several
workers restarting at once can take a cluster's capacity down together. The budget
allows ``max_restarts`` per worker per ``window`` seconds and ``max_concurrent`` restarts
in flight across the cluster; past it the PlacementPlugin quarantines instead.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Literal

__all__ = ["RestartBudget", "Decision", "Admission", "admit_restart"]


@dataclass(frozen=True)
class Decision:
    allowed: bool
    reason: str | None = None  # "budget" or "concurrency" when refused


@dataclass
class RestartBudget:
    max_restarts: int
    window: float
    max_concurrent: int = 1
    _history: dict[str, deque[float]] = field(default_factory=dict)
    _in_flight: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        if self.max_restarts < 0 or self.window <= 0 or self.max_concurrent < 1:
            raise ValueError(
                f"invalid restart budget: max_restarts={self.max_restarts!r}, "
                f"window={self.window!r}, max_concurrent={self.max_concurrent!r}"
            )

    def recent(self, key: str, now: float) -> int:
        """Restarts of ``key`` within the window ending at ``now``."""
        history = self._history.get(key)
        if not history:
            return 0
        while history and history[0] <= now - self.window:
            history.popleft()
        if not history:
            del self._history[key]  # workers come and go: keep only recent restarts
        return len(history)

    def request(self, key: str, now: float) -> Decision:
        """May ``key`` restart now? Grants start a restart that :meth:`done` ends."""
        for other in [k for k in self._history if k != key]:
            self.recent(other, now)  # forget keys whose restarts left the window
        if key in self._in_flight:
            return Decision(False, "in-flight")
        if self.recent(key, now) >= self.max_restarts:
            return Decision(False, "budget")
        if len(self._in_flight) >= self.max_concurrent:
            return Decision(False, "concurrency")
        self._in_flight.add(key)
        self._history.setdefault(key, deque()).append(now)
        return Decision(True)

    def done(self, key: str, *, counted: bool = True, now: float | None = None) -> None:
        """The restart of ``key`` ended; ``counted=False`` when it never happened."""
        self._in_flight.discard(key)
        if not counted and self._history.get(key):
            self._history[key].pop()

    @property
    def in_flight(self) -> frozenset[str]:
        return frozenset(self._in_flight)


@dataclass(frozen=True)
class Admission:
    """The answer to a worker's restart request, and what the scheduler does about it.

    ``status`` is the reply's (``RestartReply``); ``act`` is ``"restart"`` (start it),
    ``"defer"`` (cannot happen without loss now: say so, quarantine the worker's GPUs),
    ``"quarantine"`` (over budget: quarantine only) or ``"none"``.
    """

    status: Literal["accepted", "refused", "deferred", "in-flight"]
    act: Literal["restart", "defer", "quarantine", "none"]
    reason: str | None = None


def admit_restart(
    budget: RestartBudget,
    key: str,
    now: float,
    *,
    authentic: bool,
    has_nanny: bool,
    has_peer: bool,
) -> Admission:
    """Whether a worker's restart may start now.

    ``authentic``: the request comes from the worker itself. ``has_nanny``: something can
    start it again. ``has_peer``: another running worker can take its data. ``key``
    identifies the worker across restarts (its nanny), for the budget.
    """
    if not authentic:
        return Admission("refused", "none")
    if not has_nanny:
        return Admission("deferred", "defer", "no-nanny")
    if not has_peer:
        return Admission("deferred", "defer", "no-peer")
    decision = budget.request(key, now)
    if decision.allowed:
        return Admission("accepted", "restart")
    if decision.reason == "in-flight":
        return Admission("in-flight", "none")  # its restart is under way: nothing to do
    if decision.reason == "budget":
        return Admission("deferred", "quarantine", "budget")
    return Admission("deferred", "defer", decision.reason or "concurrency")
