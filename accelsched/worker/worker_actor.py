"""The one place on a worker where a decision's proposals are carried out.

As in distributed's Active Memory Manager (policies suggest, one place acts), the
worker's decisions (:func:`~accelsched.policy.leak.judge_answers`,
:class:`~accelsched.policy.leak.LeakDecisions`) only return
:class:`~accelsched.policy.proposals.Proposal` objects. :class:`WorkerActor` turns them
into what the rest of the cluster sees: events in the scheduler's log (their fields are
written here, in the order docs/events.md gives), devices withdrawn from or offered
again to placement, a garbage collection, a restart request. A test checks a decision
by its proposals and the actor by the proposals it is given.
"""

from __future__ import annotations

import gc
import itertools
from collections.abc import Callable, Iterable

from accelsched import events
from accelsched.policy.proposals import Proposal
from accelsched.worker.inventory import Inventory
from accelsched.worker.pool_freer import reclaim

__all__ = ["WorkerActor"]


class WorkerActor:
    """Carries out the worker's proposals, in the order given."""

    def __init__(
        self,
        *,
        inventory: Inventory,
        set_devices: Callable[[list[int]], None],
        emit: Callable[..., None],
        spawn: Callable[..., None],
    ) -> None:
        self.inventory = inventory
        self._set_devices = set_devices  # the devices leases may land on
        self._emit = emit  # one event to the scheduler's log
        self._spawn = spawn  # runs a coroutine function in the background
        # Move every object alive now (modules, the worker, the guard) out of the
        # collector's reach, once: a reclaim's full collection then scans only what was
        # made since (it holds the event loop). Reference counting still frees them.
        if not gc.get_freeze_count():
            gc.freeze()

    def apply(self, proposals: Iterable[Proposal]) -> None:
        """Carry out ``proposals`` in order; consecutive reclaims share one collection."""
        for action, group in itertools.groupby(proposals, key=lambda p: p.action):
            if action == "reclaim":
                reclaim([p.subject for p in group])
                continue
            # each action by the method of its name (``report-leak``: report_leak)
            act = getattr(self, action.replace("-", "_"), None)
            if act is None:
                raise ValueError(f"not a worker's action: {action!r}")
            for p in group:
                act(p)

    def withdraw(self, p: Proposal) -> None:
        """No new lease lands on the device and the worker advertises one GPU fewer
        (tasks assigned against the old count that no longer fit go back)."""
        self._emit(events.GPU_UNHEALTHY, device=p.subject, **p.detail)  # uuid, error
        self._offer()

    def recover(self, p: Proposal) -> None:
        self._emit(events.GPU_RECOVERED, device=p.subject, **p.detail)  # uuid
        self._offer()

    def _offer(self) -> None:
        """Offer what is usable now (the health record says which devices are out):
        leases at once, the count right after."""
        self._set_devices(self.inventory.usable)
        self._spawn(self.inventory.offer, self._set_devices)

    def report_leak(self, p: Proposal) -> None:
        self._emit(
            events.LEAK,
            device=p.subject,
            nbytes=int(p.figures["nbytes"]),
            threshold=int(p.figures["threshold"]),
            checks=int(p.figures["checks"]),
            prefixes=list(p.detail["prefixes"]),
            attributed=dict(p.detail["attributed"]),
            unexplained=int(p.figures["unexplained"]),
            reclaimed=int(p.figures["reclaimed"]),
        )

    def report_reclaimed(self, p: Proposal) -> None:
        self._emit(
            events.LEAK_RECLAIMED,
            device=p.subject,
            nbytes=int(p.figures["nbytes"]),
            reclaimed=int(p.figures["reclaimed"]),
            remaining=int(p.figures["remaining"]),
            threshold=int(p.figures["threshold"]),
            prefixes=list(p.detail["prefixes"]),
            seconds=p.figures["seconds"],
        )

    def ask_restart(self, p: Proposal) -> None:
        self.inventory.ask_restart(p.reason or "", int(p.figures.get("nbytes", 0)))
