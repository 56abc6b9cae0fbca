"""GPU tasks no verified GPU can take, said (:mod:`accelsched.policy.waiting` decides).

Nothing is kept per task: the tasks are those distributed holds as unrunnable, read on
a one-second tick (for the ``gpu-waiting`` event) and when a status is asked for.
"""

from __future__ import annotations

from collections.abc import Callable
from time import monotonic
from typing import TYPE_CHECKING, Any

from accelsched import events, internals
from accelsched.policy.waiting import NOTICE_AFTER, Notices, reason_for
from accelsched.protocol import (
    FALLBACK_ANNOTATION,
    GPU,
    GPU_MEMORY,
    INVALID_RESOURCE,
    REQUIREMENT_ANNOTATION,
)

if TYPE_CHECKING:
    from distributed import Scheduler

__all__ = ["WaitingTasks"]

_PERIODIC = "accelsched-waiting"
#: Seconds between looks: a waiting reason is said within NOTICE_AFTER and this.
TICK = 1.0
#: Keys named in an event, as examples.
EXAMPLES = 3


class WaitingTasks:
    """GPU tasks unplaced for :data:`~accelsched.policy.waiting.NOTICE_AFTER`, by reason."""

    def __init__(self, *, emit: Callable[..., None], active: Callable[[], bool]) -> None:
        self.scheduler: Scheduler | None = None
        self.notices = Notices()
        self._emit = emit
        self._active = active

    def start(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        internals.start_periodic(scheduler, _PERIODIC, self.tick, TICK)

    def close(self) -> None:
        if self.scheduler is not None:
            internals.stop_periodic(self.scheduler, _PERIODIC)

    def by_reason(self) -> dict[str, list[Any]]:
        """The keys of GPU tasks unplaced long enough to count, by why."""
        scheduler = self.scheduler
        if scheduler is None:
            return {}
        now = monotonic()
        largest = internals.largest_gpu_count(scheduler)
        out: dict[str, list[Any]] = {}
        for ts, since in list(internals.unrunnable(scheduler).items()):
            restrictions = ts.resource_restrictions or {}
            if now - since < NOTICE_AFTER or INVALID_RESOURCE in restrictions:
                continue  # not yet; or an invalid task, erred at the fallback's next check
            if FALLBACK_ANNOTATION in (ts.annotations or {}):
                continue  # runs its CPU form: no GPU task any more
            amount = restrictions.get(GPU) or 0
            requirement = bool(restrictions.get(GPU_MEMORY)) or REQUIREMENT_ANNOTATION in (
                ts.annotations or {}
            )
            if amount or requirement:
                out.setdefault(reason_for(amount, largest, requirement), []).append(ts.key)
        return out

    def counts(self) -> dict[str, int]:
        """``accelsched status``'s ``waiting``: how many wait, by reason."""
        return {reason: len(keys) for reason, keys in sorted(self.by_reason().items())}

    def tick(self) -> None:
        """Say each reason tasks newly wait for, once (a ``gpu-waiting`` event)."""
        if self.scheduler is None or not self._active():
            return
        waiting = self.by_reason()
        for reason in self.notices.update(waiting):
            keys = waiting[reason]
            self._emit(
                events.GPU_WAITING,
                None,
                reason=reason,
                waiting=len(keys),
                keys=[str(k) for k in keys[:EXAMPLES]],
            )
