"""When the next fallback check runs: exactly at the next deadline, not at the next tick.

The periodic check stays as a safety net; this keeps fallback latency close to the
timeout instead of up to one ``fallback_interval`` past it, with one timer at a time
(the earliest deadline) and at most one check queued for a deadline already passed.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from time import monotonic
from typing import TYPE_CHECKING, Any

import dask.config

from accelsched import internals
from accelsched.policy.timeouts import no_workers_conflict

if TYPE_CHECKING:
    from distributed import Scheduler

logger = logging.getLogger(__name__)

__all__ = ["CheckTimer", "NoWorkersWarning"]


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


class NoWorkersWarning:
    """Warns once when distributed's ``no-workers-timeout`` would fail unplaced tasks
    before they could fall back (a config read per timeout value, not per task)."""

    def __init__(self) -> None:
        self._warned = False
        self._checked: set[float] = set()

    def check(self, timeout: float | None) -> None:
        if timeout is None or self._warned or timeout in self._checked:
            return
        self._checked.add(timeout)
        limit = dask.config.get("distributed.scheduler.no-workers-timeout", None)
        msg = no_workers_conflict(limit, timeout)
        if msg is not None:
            self._warned = True
            logger.warning(msg)
            warnings.warn(msg, RuntimeWarning, stacklevel=3)
