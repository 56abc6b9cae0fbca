"""Quarantine: a worker's GPUs leave placement, and stay out until it leaves.

A worker whose restart cannot happen now, or that restarted too often lately, keeps
leaking: no GPU task may be placed on it, and the GPU tasks already sent to it (a queue
of them, often) go elsewhere or fall back. Its guard sends those back as they reach
execution, once told to drain (:meth:`~accelsched.scheduler.authority.Authority.tell_draining`).
A restarted worker registers anew, unquarantined.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from accelsched import events, internals
from accelsched.scheduler.authority import Authority
from accelsched.scheduler.gpu_counts import GpuCounts
from accelsched.scheduler.grants import Grants

if TYPE_CHECKING:
    from distributed import Scheduler

__all__ = ["Quarantine"]


class Quarantine:
    """Takes a worker's GPUs out of placement, once, and says so."""

    def __init__(
        self,
        scheduler: Scheduler,
        *,
        grants: Grants,
        counts: GpuCounts,
        authority: Authority,
        emit: Callable[..., None],
    ) -> None:
        self.scheduler = scheduler
        self._grants = grants
        self._counts = counts
        self._authority = authority
        self._emit = emit

    def add(self, worker: str, reason: str) -> None:
        """Quarantine ``worker`` (a worker gone, or already quarantined: nothing)."""
        ws = self.scheduler.workers.get(worker)
        if ws is None or not self._grants.quarantine(worker, reason):
            return
        self._counts.zero(ws)
        # GPU tasks already sent to it go elsewhere too
        internals.spawn(self.scheduler, self._authority.tell_draining, worker, True)
        self._emit(events.QUARANTINE, worker, reason=reason)
