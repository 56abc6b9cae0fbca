"""Restart coordination: a leaking worker restarts without losing data, or is quarantined.

A worker's guard asks (``accelsched_restart``); :func:`accelsched.policy.budget.admit_restart`
proposes what to do, the scheduler's actor (:mod:`accelsched.scheduler.scheduler_actor`) carries it
out, and :func:`accelsched.policy.budget.restart_reply` is the answer. An admitted restart
drains the worker (its guard sends queued GPU tasks back to the scheduler, its executing
tasks finish), retires it (its keys move to peers), checks that worked, then restarts it
through its nanny: the only order that loses nothing. When it cannot happen without loss,
or past the restart budget, the worker's GPUs are quarantined instead
(:class:`~accelsched.scheduler.quarantine.Quarantine`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from time import monotonic, time
from typing import TYPE_CHECKING, Any

from accelsched import events, internals
from accelsched.policy.budget import RestartBudget, admit_restart, keeps_devices, restart_reply
from accelsched.protocol import RESTART_HANDLER, RestartReply
from accelsched.scheduler.authority import Authority
from accelsched.scheduler.quarantine import Quarantine

if TYPE_CHECKING:
    from distributed import Scheduler
    from distributed.core import Status
    from distributed.scheduler import WorkerState

    from accelsched.policy.proposals import Act

__all__ = ["Restarts", "DRAIN_TIMEOUT"]

logger = logging.getLogger(__name__)

#: How long a restart waits for the worker's executing tasks before giving up.
DRAIN_TIMEOUT = 300.0
#: How long a restart waits for the old process to leave the scheduler.
GONE_TIMEOUT = 30.0


class Restarts:
    """Admits restart requests and carries them out one retirement at a time."""

    def __init__(
        self,
        *,
        budget: RestartBudget,
        authority: Authority,
        quarantine: Quarantine,
        emit: Callable[..., None],
        active: Callable[[], bool],
        act: Act,
    ) -> None:
        self.scheduler: Scheduler | None = None
        self.budget = budget
        self._authority = authority
        self._quarantine = quarantine
        self.deferred: dict[str, str] = {}  # worker -> reason of its last deferral
        # Retire and kill one worker at a time: while a retired worker is still
        # registered, another retirement could drop the only other copy of its keys
        # ("the retired worker still has it") just before it is killed.
        self._retire_lock = asyncio.Lock()
        self._emit = emit
        self._active = active
        self._act = act

    def start(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def remove_worker(self, worker: str) -> None:
        self.deferred.pop(worker, None)

    async def handle_restart(
        self,
        comm: Any,
        worker: str,
        process: str = "",
        request: str = "",
        reason: str = "leak",
        **figures: Any,
    ) -> RestartReply:
        """A worker asks to be restarted.

        Only from the process registered at that address, once per request id
        (:meth:`~accelsched.scheduler.authority.Authority.admits`): a late request from a
        process since replaced does not restart the new one. The restart runs in the
        background; the reply says whether it was accepted.
        """
        scheduler = self.scheduler
        assert scheduler is not None
        if not self._active():
            return {"status": "no-plugin"}
        ws = scheduler.workers.get(worker)
        if ws is None or not self._authority.admits(worker, process, request, RESTART_HANDLER):
            return restart_reply(None, authentic=False)
        proposal = admit_restart(
            self.budget,
            ws.nanny or worker,
            monotonic(),
            worker=worker,
            why=reason,
            authentic=True,
            has_nanny=ws.nanny is not None,
            has_peer=internals.has_running_peer(scheduler, ws),
        )
        if proposal is not None:
            self._act([proposal], keep_devices=keeps_devices(reason))
        return restart_reply(proposal)

    def begin(self, worker: str, why: str) -> None:
        """Start the admitted restart of ``worker`` in the background (the actor's
        ``restart``); its budget is spent until it ends."""
        scheduler = self.scheduler
        assert scheduler is not None
        ws = scheduler.workers[worker]  # admitted just now, with no wait since
        assert ws.nanny is not None
        internals.spawn(scheduler, self.restart, ws, ws.nanny, why)

    async def restart(self, ws: WorkerState, budget_key: str, reason: str) -> None:
        """Drain, retire, check, restart: the only order that loses nothing."""
        scheduler = self.scheduler
        assert scheduler is not None
        worker = ws.address
        stimulus_id = f"accelsched-restart-{time()}"
        start = monotonic()
        restarted = False
        previous: Status | None = None
        try:
            if scheduler.workers.get(worker) is not ws:
                return  # it left (or another process took its address) meanwhile
            previous = ws.status  # what to resume to if this fails from here on
            internals.drain(scheduler, ws, stimulus_id)
            # its queue goes elsewhere now; only what it runs is waited for
            queued = internals.assigned(ws)
            await self._authority.tell_draining(worker, True)
            internals.send_queue_away(scheduler, ws)  # what has not started moves to peers
            deadline = monotonic() + DRAIN_TIMEOUT
            while internals.is_processing(ws) and monotonic() < deadline:
                await asyncio.sleep(0.05)
            if internals.is_processing(ws):
                self._give_up(ws, previous, "busy", stimulus_id, reason)
                return
            async with self._retire_lock:
                if scheduler.workers.get(worker) is not ws:
                    return
                moved = internals.keys_held(ws)
                if not await internals.retire(scheduler, ws, stimulus_id):
                    self._give_up(ws, previous, "no-peer", stimulus_id, reason)
                    return
                if internals.holds_sole_copy(ws):
                    self._give_up(ws, previous, "retire-failed", stimulus_id, reason)
                    return
                outcome = await internals.restart(scheduler, ws, stimulus_id)
                restarted = outcome == "OK"
                if not restarted:
                    self._give_up(ws, previous, f"restart-failed: {outcome}", stimulus_id, reason)
                    return
                # gone from who_has before the next retirement
                await internals.wait_gone(scheduler, ws, GONE_TIMEOUT)
            self._emit(
                events.RESTART,
                worker,
                reason=reason,
                moved=moved,
                assigned=queued,
                seconds=round(monotonic() - start, 3),
            )
        except Exception as exc:
            logger.exception("accelsched: restart of %s failed", worker)
            if previous is not None:
                self._give_up(ws, previous, f"restart-failed: {exc!r}", stimulus_id, reason)
        finally:
            self.budget.done(budget_key, counted=restarted)

    def _give_up(
        self, ws: WorkerState, previous: Status, reason: str, stimulus_id: str, why: str
    ) -> None:
        """Quarantine first, then take the worker back into service.

        In this order the GPU tasks that piled up during the drain are not offered to the
        worker that leaks: they wait for (or fall back from) other GPUs.
        """
        assert self.scheduler is not None
        quarantine = not keeps_devices(why)
        self.defer(ws.address, reason, quarantine=quarantine)
        internals.resume(self.scheduler, ws, previous, stimulus_id)
        if not quarantine:  # back in service with its devices that answer: run GPU tasks
            internals.spawn(self.scheduler, self._authority.tell_draining, ws.address, False)

    def defer(self, worker: str, reason: str, *, quarantine: bool = True) -> None:
        """The restart cannot happen without loss now: say so once, and quarantine."""
        if self.scheduler is None or worker not in self.scheduler.workers:
            return  # it left meanwhile: nothing to defer
        if self.deferred.get(worker) != reason:
            self.deferred[worker] = reason
            self._emit(events.RESTART_DEFERRED, worker, reason=reason)
        if quarantine:
            self._quarantine.add(worker, f"restart-deferred: {reason}")
