"""The one place the scheduler acts on a decision.

distributed's Active Memory Manager has its policies suggest and acts in one place;
accelsched does the same. The decisions (:mod:`accelsched.policy`) answer with
:class:`~accelsched.policy.proposals.Proposal` objects and change nothing; the parts
that ask them (the fallback check, the restart handler) hand the proposals here, and
:class:`SchedulerActor` carries each out through the part that knows how:

========== ============================================================================
fall-back  :meth:`Fallback.fall_back <accelsched.scheduler.fallback.Fallback.fall_back>`:
           the task's GPU restriction lifted, marked, sent on; one ``fallback`` event
           per check (one per task up to a few)
err        :meth:`Fallback.err <accelsched.scheduler.fallback.Fallback.err>`: the task
           errs, naming why it can never be placed
restart    :meth:`Restarts.begin <accelsched.scheduler.restarts.Restarts.begin>`:
           drain, retire, check, restart, in the background
defer      :meth:`Restarts.defer <accelsched.scheduler.restarts.Restarts.defer>`:
           ``restart-deferred`` (when its reason is news), and quarantine
quarantine :meth:`Quarantine.add <accelsched.scheduler.quarantine.Quarantine.add>`,
           reason ``restart-<reason>`` (``restart-budget``)
========== ============================================================================

A worker that asked for its restart because a device failed keeps the devices that
answer (``keep_devices``, :func:`accelsched.policy.budget.keeps_devices`): its deferral is
said but quarantines nothing, and over its budget nothing happens.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from accelsched.policy.proposals import Proposal

if TYPE_CHECKING:
    from accelsched.scheduler.fallback import Fallback
    from accelsched.scheduler.quarantine import Quarantine
    from accelsched.scheduler.restarts import Restarts

__all__ = ["SchedulerActor"]


class SchedulerActor:
    """Carries out every scheduler-side proposal."""

    def __init__(self, *, fallback: Fallback, restarts: Restarts, quarantine: Quarantine) -> None:
        self._fallback = fallback
        self._restarts = restarts
        self._quarantine = quarantine

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
                self._restarts.defer(str(p.subject), p.reason or "", quarantine=not keep_devices)
            elif p.action == "quarantine":
                if not keep_devices:
                    self._quarantine.add(str(p.subject), f"restart-{p.reason}")
            else:
                raise ValueError(f"not a scheduler action: {p!r}")
        if fall_back:
            self._fallback.fall_back(fall_back)
