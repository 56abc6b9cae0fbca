"""Who speaks for a worker: only the worker itself.

Every request to the scheduler names a worker and carries a one-time id. Before acting,
the scheduler calls the named worker back, at the address it registered under, and asks
whether the id is one of its outstanding requests (``accelsched_confirm``). Only the
process that sent the request can say yes, and nothing secret ever leaves either side.
The connection's own address proves nothing either way (a multi-homed worker or one
behind NAT connects from another address than it advertises). A refusal is logged as a
``request-refused`` event, at most once a minute per worker and handler, so a flood of
forged requests cannot push other events out of the scheduler's log.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from time import monotonic
from typing import TYPE_CHECKING, Any

from accelsched import events
from accelsched.protocol import CONFIRM_HANDLER, ConfirmReply

if TYPE_CHECKING:
    from distributed import Scheduler

__all__ = ["Authority", "REFUSED_EVERY"]

logger = logging.getLogger(__name__)

#: At most one ``request-refused`` event per worker and handler this often (seconds).
REFUSED_EVERY = 60.0


class Authority:
    """Confirms requests with the workers they name; logs the refusals."""

    def __init__(self, *, emit: Callable[..., None]) -> None:
        self.scheduler: Scheduler | None = None
        self._emit = emit
        self._refusals: dict[tuple[str, str], tuple[float, int]] = {}  # -> (last, since)

    async def confirmed(self, comm: Any, worker: str, request: Any, handler: str) -> bool:
        """Whether ``worker`` itself sent ``request``: ask it, at its registered address."""
        assert self.scheduler is not None
        reply: ConfirmReply | None = None
        if isinstance(request, str) and request:
            try:
                reply = await getattr(self.scheduler.rpc(worker), CONFIRM_HANDLER)(request=request)
            except Exception as exc:  # gone, no guard, or not a worker at all
                logger.debug("accelsched: %s could not confirm a request: %r", worker, exc)
        if isinstance(reply, dict) and reply.get("confirmed") is True:
            return True
        self._refused_request(worker, handler, str(getattr(comm, "peer_address", None)))
        return False

    def _refused_request(self, worker: str, handler: str, peer: str) -> None:
        """Log a refusal; a flood of them (forged in a loop) logs one a minute per worker
        and handler, with how many it stands for, so it cannot push other events out."""
        now = monotonic()
        key = (worker, handler)
        last, suppressed = self._refusals.get(key, (None, 0))
        if last is not None and now - last < REFUSED_EVERY:
            self._refusals[key] = (last, suppressed + 1)
            return
        self._refusals[key] = (now, 0)
        logger.warning(
            "accelsched: refused %s naming %s from %s: that worker did not send it",
            handler,
            worker,
            peer,
        )
        self._emit(events.REQUEST_REFUSED, worker, handler=handler, peer=peer, repeats=suppressed)
