"""When the next fallback check runs: exactly at the next deadline, not at the next tick.

The periodic check stays as a safety net; this keeps fallback latency close to the
timeout instead of up to one ``fallback_interval`` past it, with one timer at a time
(the earliest deadline) and at most one check queued for a deadline already passed.
"""

from __future__ import annotations

from collections.abc import Callable
from time import monotonic
from typing import TYPE_CHECKING, Any

from accelsched import internals

if TYPE_CHECKING:
    from distributed import Scheduler

__all__ = ["CheckTimer"]


class CheckTimer:
    """Calls ``check`` at a deadline on the scheduler's event loop."""

    def __init__(self, check: Callable[[], None]) -> None:
        self.scheduler: Scheduler | None = None
        self._check = check
        self._soon = False  # a check is queued to run at once
        self._timer: tuple[float, Any] | None = None  # (deadline, handle)

    def start(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def checking(self) -> None:
        """A check runs now: a deadline passed from here on queues another."""
        self._soon = False

    def at(self, deadline: float | None) -> None:
        """Check at ``deadline`` (at once when it passed; None: nothing to time)."""
        if deadline is None or self.scheduler is None:
            return
        if deadline <= monotonic():
            if not self._soon:
                self._soon = True
                internals.call_soon(self.scheduler, self._check)
            return
        self._wake_at(deadline)

    def _wake_at(self, deadline: float) -> None:
        scheduler = self.scheduler
        assert scheduler is not None
        if self._timer is not None:
            if self._timer[0] <= deadline:
                return
            internals.cancel_call(scheduler, self._timer[1])

        def fire() -> None:
            self._timer = None
            self._check()

        delay = max(0.0, deadline - monotonic()) + 0.001
        self._timer = (deadline, internals.call_later(scheduler, delay, fire))
