"""Restart coordination: a leaking worker restarts without losing data, or is quarantined.

A worker's guard asks (``accelsched_restart``); :func:`accelsched.policy.budget.admit_restart`
proposes what to do, the scheduler's actor (:mod:`accelsched.scheduler.scheduler_actor`) carries it
out, and :func:`accelsched.policy.budget.restart_reply` is the answer. An admitted restart
drains the worker (its guard sends queued GPU tasks back to the scheduler, its executing
tasks finish), retires it (its keys move to peers), checks that worked, then restarts it
through its nanny (:func:`accelsched.internals.replace_worker`). When that cannot happen
without loss, the restart is deferred (a ``defer`` proposal: the actor quarantines).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from functools import partial
from time import monotonic, time
from typing import TYPE_CHECKING, Any

from accelsched import events, internals
from accelsched.policy.budget import RestartBudget, admit_restart, keeps_devices, restart_reply
from accelsched.policy.proposals import Proposal
from accelsched.protocol import RESTART_HANDLER, RestartReply
from accelsched.scheduler.authority import Authority

if TYPE_CHECKING:
    from distributed import Scheduler
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
        scheduler: Scheduler,
        *,
        budget: RestartBudget,
        authority: Authority,
        emit: Callable[..., None],
        active: Callable[[], bool],
        act: Act,
    ) -> None:
        self.scheduler = scheduler
        self.budget = budget
        self._authority = authority
        self._retire_lock = asyncio.Lock()  # see internals.replace_worker
        self._emit = emit
        self._active = active
        self._act = act

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
        ws = self.scheduler.workers[worker]  # admitted just now, with no wait since
        assert ws.nanny is not None
        internals.spawn(self.scheduler, self.restart, ws, ws.nanny, why)

    async def restart(self, ws: WorkerState, budget_key: str, why: str) -> None:
        """Drain, retire, check, restart: the only order that loses nothing. Given up,
        the restart is deferred first (the actor quarantines a leaking worker), then the
        worker taken back into service: in this order the GPU tasks that piled up during
        the drain are not offered to the worker that leaks, they wait for (or fall back
        from) other GPUs."""
        scheduler = self.scheduler
        start, previous = monotonic(), ws.status
        stimulus_id = f"accelsched-restart-{time()}"
        outcome: dict[str, int] | str | None = None
        try:
            outcome = await internals.replace_worker(
                scheduler,
                ws,
                stimulus_id,
                tell_draining=partial(self._authority.tell_draining, ws.address),
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
            self._act([Proposal("defer", ws.address, outcome)], keep_devices=keep)
            internals.resume(scheduler, ws, previous, stimulus_id)
            if keep:  # back in service with its devices that answer: run GPU tasks
                internals.spawn(scheduler, self._authority.tell_draining, ws.address, False)
