"""The one place the scheduler acts on a decision, restarts included.

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
restart    :meth:`SchedulerActor.restart`: drain, retire, check, restart, in the
           background
defer      ``restart-deferred`` (when its reason is news), and quarantine
quarantine :meth:`SchedulerActor.quarantine`, reason ``restart-<reason>``
           (``restart-budget``)
========== ============================================================================

A restart: a worker's guard asks (``accelsched_restart``, admitted once and only from
the process it names: :meth:`DeviceReports.admits
<accelsched.scheduler.device_reports.DeviceReports.admits>`);
:func:`accelsched.policy.budget.admit_restart` proposes what to do and
:func:`accelsched.policy.budget.restart_reply` is the answer. An admitted restart drains
the worker (its guard sends queued GPU tasks back to the scheduler, its executing tasks
finish), retires it (its keys move to peers), checks that worked, then restarts it
through its nanny (:func:`accelsched.internals.replace_worker`). When that cannot happen
without loss, the restart is deferred.

Quarantine: a worker whose restart cannot happen now, or that restarted too often lately,
keeps leaking. Its GPUs leave placement (its GPU count is 0) until it leaves, and the GPU
tasks already sent to it go elsewhere or fall back: its guard sends them back as they
reach execution, once told to drain (:meth:`SchedulerActor.tell_draining`; the order
names the process it is meant for: a new process that took the address since ignores
it). A restarted worker registers anew, unquarantined.

A worker that asked for its restart because a device failed keeps the devices that
answer (``keep_devices``, :func:`accelsched.policy.budget.keeps_devices`): its deferral is
said but quarantines nothing, and over its budget nothing happens.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from functools import partial
from time import monotonic, time
from typing import TYPE_CHECKING, Any

from accelsched import events, internals
from accelsched.events import shown
from accelsched.policy.budget import RestartBudget, admit_restart, keeps_devices, restart_reply
from accelsched.policy.proposals import Proposal
from accelsched.protocol import DRAIN_HANDLER, RESTART_HANDLER, RestartReply
from accelsched.scheduler.device_reports import DeviceReports
from accelsched.scheduler.grants import Grants

if TYPE_CHECKING:
    from distributed import Scheduler
    from distributed.scheduler import WorkerState

    from accelsched.scheduler.fallback import Fallback

__all__ = ["SchedulerActor", "DRAIN_TIMEOUT"]

logger = logging.getLogger(__name__)

#: How long a restart waits for the worker's executing tasks before giving up.
DRAIN_TIMEOUT = 300.0
#: How long a restart waits for the old process to leave the scheduler.
GONE_TIMEOUT = 30.0


class SchedulerActor:
    """Carries out every scheduler-side proposal; serves the restart handler."""

    def __init__(
        self,
        scheduler: Scheduler,
        *,
        fallback: Fallback,
        grants: Grants,
        reports: DeviceReports,
        budget: RestartBudget,
        emit: Callable[..., None],
        active: Callable[[], bool],
    ) -> None:
        self.scheduler = scheduler
        self._fallback = fallback
        self._grants = grants
        self._reports = reports
        self.budget = budget
        self._emit = emit
        self._active = active
        self._retire_lock = asyncio.Lock()  # see internals.replace_worker
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
                self.begin(str(p.subject), p.reason or "leak")
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
        self._reports.zero(ws)
        # GPU tasks already sent to it go elsewhere too
        internals.spawn(self.scheduler, self.tell_draining, worker, True)
        self._emit(events.QUARANTINE, worker, reason=reason)

    async def tell_draining(self, worker: str, on: bool) -> None:
        """Order the worker's guard to send GPU tasks back as they reach execution (or to
        run them again).

        distributed sends every GPU task to a valid worker at once; a worker restarting
        or quarantined would otherwise work through its queue. Only the worker knows which
        tasks it runs, so it turns the rest away itself (distributed's ``Reschedule``):
        nothing that finished is released, nothing runs twice. The order names the
        process it is meant for; a worker without a guard works through its queue.
        """
        ws = self.scheduler.workers.get(worker)
        if ws is None:
            return  # gone: nothing to drain
        try:
            await getattr(self.scheduler.rpc(worker), DRAIN_HANDLER)(on=on, process=ws.server_id)
        except Exception as exc:  # gone, or no guard
            logger.debug("accelsched: %s was not told to drain (%s): %r", worker, on, exc)

    # --- restarts ------------------------------------------------------------------------

    async def handle_restart(
        self,
        comm: Any,
        worker: str,
        process: str = "",
        request: str = "",
        reason: str = "leak",
        **figures: Any,
    ) -> RestartReply:
        """A worker asks to be restarted, from the process registered at that address,
        once per request id: a late request from a process since replaced does not
        restart the new one. The restart runs in the background; the reply says whether
        it was accepted."""
        if not self._active():
            return {"status": "no-plugin"}
        ws = self.scheduler.workers.get(worker)
        if ws is None or not self._reports.admits(worker, process, request, RESTART_HANDLER):
            return restart_reply(None, authentic=False)
        proposal = admit_restart(
            self.budget,
            ws.nanny or worker,
            monotonic(),
            worker=worker,
            why=reason,
            has_nanny=ws.nanny is not None,
            has_peer=internals.has_running_peer(self.scheduler, ws),
        )
        if proposal is not None:
            self.act([proposal], keep_devices=keeps_devices(reason))
        return restart_reply(proposal)

    def begin(self, worker: str, why: str) -> None:
        """Start the admitted restart of ``worker`` in the background; its budget is
        spent until it ends."""
        ws = self.scheduler.workers[worker]  # admitted just now, with no wait since
        assert ws.nanny is not None
        internals.spawn(self.scheduler, self.restart, ws, ws.nanny, why)

    async def restart(self, ws: WorkerState, budget_key: str, why: str) -> None:
        """Drain, retire, check, restart: the only order that loses nothing. Given up,
        the restart is deferred first (a leaking worker is quarantined), then the worker
        taken back into service: in this order the GPU tasks that piled up during the
        drain are not offered to the worker that leaks, they wait for (or fall back
        from) other GPUs."""
        scheduler = self.scheduler
        start, previous = monotonic(), ws.status
        # the reason in distributed's own lines too ("Retire worker ... stimulus_id=...")
        # (a worker's own word: a plain token only)
        tag = why if why.replace("-", "").isalnum() else "other"
        stimulus_id = f"accelsched-restart-{tag}-{time()}"
        logger.info(
            "accelsched: restarting %s (%s): drained, retired to its peers, then restarted "
            "through its nanny (stimulus_id %s)",
            ws.address,
            shown(why),
            stimulus_id,
        )
        outcome: dict[str, int] | str | None = None
        try:
            outcome = await internals.replace_worker(
                scheduler,
                ws,
                stimulus_id,
                tell_draining=partial(self.tell_draining, ws.address),
                lock=self._retire_lock,
                drain_timeout=DRAIN_TIMEOUT,
                gone_timeout=GONE_TIMEOUT,
            )
        except Exception as exc:
            logger.exception("accelsched: restart of %s failed", ws.address)
            outcome = f"restart-failed: {exc!r}"
        finally:
            self.budget.done(budget_key, counted=isinstance(outcome, dict))
        if isinstance(outcome, dict):
            seconds = round(monotonic() - start, 3)
            self._emit(events.RESTART, ws.address, reason=why, **outcome, seconds=seconds)
        elif outcome is not None:
            keep = keeps_devices(why)
            self.act([Proposal("defer", ws.address, outcome)], keep_devices=keep)
            internals.resume(scheduler, ws, previous, stimulus_id)
            if keep:  # back in service with its devices that answer: run GPU tasks
                internals.spawn(scheduler, self.tell_draining, ws.address, False)
