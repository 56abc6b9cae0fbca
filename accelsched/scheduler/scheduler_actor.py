"""The one place the scheduler acts on a decision.

distributed's Active Memory Manager has its policies suggest and acts in one place;
accelsched does the same. The decisions (:mod:`accelsched.policy`) answer with
:class:`~accelsched.policy.proposals.Proposal` objects and change nothing; the parts
that ask them (the fallback check, the restart handler and procedure) hand the proposals
here, and :class:`SchedulerActor` carries each out:

========== ============================================================================
fall-back  :meth:`Fallback.fall_back <accelsched.scheduler.fallback.Fallback.fall_back>`:
           the task's GPU restriction lifted, marked, sent on; one ``fallback`` event
           per check (one per task up to a few)
err        :meth:`Fallback.err <accelsched.scheduler.fallback.Fallback.err>`: the task
           errs, naming why it can never be placed
restart    :meth:`Restarts.begin <accelsched.scheduler.restarts.Restarts.begin>`:
           drain, retire, check, restart, in the background
defer      ``restart-deferred`` (when its reason is news), and quarantine
quarantine :meth:`SchedulerActor.quarantine`, reason ``restart-<reason>``
           (``restart-budget``)
========== ============================================================================

Quarantine: a worker whose restart cannot happen now, or that restarted too often lately,
keeps leaking. Its GPUs leave placement (its GPU count is 0) until it leaves, and the GPU
tasks already sent to it go elsewhere or fall back: its guard sends them back as they
reach execution, once told to drain. A restarted worker registers anew, unquarantined.

A worker that asked for its restart because a device failed keeps the devices that
answer (``keep_devices``, :func:`accelsched.policy.budget.keeps_devices`): its deferral is
said but quarantines nothing, and over its budget nothing happens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from accelsched import events, internals
from accelsched.policy.proposals import Proposal
from accelsched.scheduler.authority import Authority
from accelsched.scheduler.device_reports import DeviceReports
from accelsched.scheduler.grants import Grants

if TYPE_CHECKING:
    from distributed import Scheduler

    from accelsched.scheduler.fallback import Fallback
    from accelsched.scheduler.restarts import Restarts

__all__ = ["SchedulerActor"]


class SchedulerActor:
    """Carries out every scheduler-side proposal."""

    def __init__(
        self,
        scheduler: Scheduler,
        *,
        fallback: Fallback,
        restarts: Restarts,
        grants: Grants,
        counts: DeviceReports,
        authority: Authority,
        emit: Callable[..., None],
    ) -> None:
        self.scheduler = scheduler
        self._fallback = fallback
        self._restarts = restarts
        self._grants = grants
        self._counts = counts
        self._authority = authority
        self._emit = emit
        self.deferred: dict[str, str] = {}  # worker -> reason of its last deferral

    def remove_worker(self, worker: str) -> None:
        self.deferred.pop(worker, None)

    def act(self, proposals: Iterable[Proposal], *, keep_devices: bool = False) -> None:
        """Carry out ``proposals``, in order; fallbacks together, after the rest, so one
        check's tasks are sent on (and told of) at once."""
        fall_back: list[Proposal] = []
        for p in proposals:
            if p.action == "fall-back":
                fall_back.append(p)
            elif p.action == "err":
                self._fallback.err(p)
            elif p.action == "restart":
                self._restarts.begin(str(p.subject), p.reason or "leak")
            elif p.action == "defer":
                self.defer(str(p.subject), p.reason or "", quarantine=not keep_devices)
            elif p.action == "quarantine":
                if not keep_devices:
                    self.quarantine(str(p.subject), f"restart-{p.reason}")
            else:
                raise ValueError(f"not a scheduler action: {p!r}")
        if fall_back:
            self._fallback.fall_back(fall_back)

    def defer(self, worker: str, reason: str, *, quarantine: bool = True) -> None:
        """The restart cannot happen without loss now: say so once, and quarantine."""
        if worker not in self.scheduler.workers:
            return  # it left meanwhile: nothing to defer
        if self.deferred.get(worker) != reason:
            self.deferred[worker] = reason
            self._emit(events.RESTART_DEFERRED, worker, reason=reason)
        if quarantine:
            self.quarantine(worker, f"restart-deferred: {reason}")

    def quarantine(self, worker: str, reason: str) -> None:
        """Take ``worker``'s GPUs out of placement, once, and say so (a worker gone, or
        quarantined already: nothing)."""
        ws = self.scheduler.workers.get(worker)
        if ws is None or not self._grants.quarantine(worker, reason):
            return
        self._counts.zero(ws)
        # GPU tasks already sent to it go elsewhere too
        internals.spawn(self.scheduler, self._authority.tell_draining, worker, True)
        self._emit(events.QUARANTINE, worker, reason=reason)
