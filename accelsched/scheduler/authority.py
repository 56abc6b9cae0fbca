"""Requests reach the process they are about, once; so do the scheduler's orders.

The threat model is distributed's (docs/architecture.md): anyone connected is trusted,
TLS keeps strangers out. What is guarded against here are stale, replayed and
misdirected messages, which happen without anyone meaning harm:

- a worker's request (``accelsched_inventory``, ``accelsched_offer``,
  ``accelsched_restart``) is acted on only if the process it comes from is the one the
  scheduler holds at the address it names, and only once per id
  (:class:`~accelsched.policy.requests.Requests`); a refusal is logged as a
  ``request-refused`` event;
- the scheduler's drain order (``accelsched_drain``) names the process it is meant for:
  a new process that took the address since ignores it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from accelsched import events
from accelsched.policy.requests import Requests
from accelsched.protocol import DRAIN_HANDLER

if TYPE_CHECKING:
    from distributed import Scheduler

__all__ = ["Authority"]

logger = logging.getLogger(__name__)


class Authority:
    """Admits workers' requests, and sends the scheduler's drain orders."""

    def __init__(self, scheduler: Scheduler, *, emit: Callable[..., None]) -> None:
        self.scheduler = scheduler
        self._emit = emit
        self._requests = Requests()

    def admits(self, worker: str, process: Any, request: Any, handler: str) -> bool:
        """Whether to act on ``request`` to ``handler``, naming ``worker``, from
        ``process`` (a worker unknown here: no, and no event; its handler says so)."""
        ws = self.scheduler.workers.get(worker)
        registered = None if ws is None else ws.server_id
        refusal = self._requests.refusal(worker, process, registered, request)
        if refusal is not None and ws is not None:
            logger.warning("accelsched: refused %s naming %s: %s", handler, worker, refusal)
            self._emit(events.REQUEST_REFUSED, worker, handler=handler, reason=refusal)
        return refusal is None

    def forget(self, worker: str) -> None:
        """The worker left: the ids of its process go with it."""
        self._requests.forget(worker)

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
