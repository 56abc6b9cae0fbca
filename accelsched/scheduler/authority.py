"""Who speaks for a worker: only the worker itself.

Every request to the scheduler names a worker and carries a one-time id. Before acting,
the scheduler calls the named worker back, at the address it registered under, and asks
whether the id is one of its outstanding requests (``accelsched_confirm``), sent to this
handler with this content (its fingerprint, :mod:`accelsched.policy.requests`). Only the process
that sent the request can say yes, once, and nothing secret ever leaves either side.

The scheduler's own orders to a worker (``accelsched_drain``) go the other way: the
worker's guard asks the scheduler back (its ``accelsched_confirm``) before it obeys, so
nobody but the scheduler can drain a worker.
The connection's own address proves nothing either way (a multi-homed worker or one
behind NAT connects from another address than it advertises). A refusal is logged as a
``request-refused`` event, at most once a minute per worker and handler, so a flood of
forged requests cannot push other events out of the scheduler's log; the one exception
is a worker's own restart request that cannot be confirmed because the scheduler is
replacing its process at that moment.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Mapping
from time import monotonic
from typing import TYPE_CHECKING, Any

from accelsched import events, internals
from accelsched.policy.requests import Outstanding, fingerprint
from accelsched.protocol import CONFIRM_HANDLER, DRAIN_HANDLER, ConfirmReply

if TYPE_CHECKING:
    from distributed import Scheduler

__all__ = ["Authority", "REFUSED_EVERY"]

logger = logging.getLogger(__name__)

#: At most one ``request-refused`` event per worker and handler this often (seconds).
REFUSED_EVERY = 60.0
#: The orders the scheduler gives workers (what a worker may ask it to confirm).
ORDERS = frozenset({DRAIN_HANDLER})


class Authority:
    """Confirms requests with the workers they name, gives and confirms the scheduler's
    own orders, and logs the refusals."""

    def __init__(self, scheduler: Scheduler, *, emit: Callable[..., None]) -> None:
        self.scheduler = scheduler
        self._emit = emit
        self._refusals: dict[tuple[str, str], tuple[float, int]] = {}  # -> (last, since)
        self.orders = Outstanding()  # the scheduler's own orders to workers, unconfirmed
        self._tokens: dict[str, str] = {}  # worker -> the token its events carry

    def start(self) -> None:
        """Answer the workers asking whether an order is the scheduler's."""
        internals.install_handler(self.scheduler, CONFIRM_HANDLER, self.confirm_order)

    def stop(self) -> None:
        internals.remove_handler(self.scheduler, CONFIRM_HANDLER, self.confirm_order)

    async def confirmed(
        self,
        comm: Any,
        worker: str,
        request: Any,
        handler: str,
        content: Mapping[str, Any],
        *,
        replacing: bool = False,
    ) -> bool:
        """Whether ``worker`` itself sent ``request`` to ``handler`` saying ``content``:
        ask it, at its registered address.

        ``replacing``: the scheduler is replacing that worker's process now. A request
        with an id whose call back then fails to reach the worker is refused without the
        forged-request report: it is the worker's own, asked again while its process
        was going (a reply saying no, or a request without an id, is reported as ever).
        """
        reply: ConfirmReply | None = None
        unreachable = False
        if isinstance(request, str) and request:
            try:
                reply = await getattr(self.scheduler.rpc(worker), CONFIRM_HANDLER)(
                    request=request, fingerprint=fingerprint(handler, content)
                )
            except internals.UNREACHABLE as exc:  # gone, or going
                logger.debug("accelsched: %s could not confirm a request: %r", worker, exc)
                unreachable = True
            except Exception as exc:  # no guard, or not a worker at all
                logger.debug("accelsched: %s could not confirm a request: %r", worker, exc)
        if isinstance(reply, dict) and reply.get("confirmed") is True:
            return True
        if not (unreachable and replacing):
            self._refused_request(worker, handler, str(getattr(comm, "peer_address", None)))
        return False

    def token_for(self, worker: str) -> str:
        """The token ``worker``'s guard puts on its events (given in its inventory reply,
        which only that worker's process receives)."""
        return self._tokens.setdefault(worker, secrets.token_hex(16))

    def speaks_for(self, worker: Any, token: Any) -> str | None:
        """The worker whose token this is (None: nobody's); ``worker`` as named."""
        known = self._tokens.get(worker) if isinstance(worker, str) else None
        if known is None or not isinstance(token, str):
            return None
        return worker if secrets.compare_digest(known, token) else None

    def forget(self, worker: str) -> None:
        """The worker left: its token goes (a worker at the same address gets a new one)."""
        self._tokens.pop(worker, None)

    def order(self, handler: str, content: Mapping[str, Any]) -> str:
        """An id for an order the scheduler is about to send (its worker confirms it)."""
        return self.orders.new(handler, content)

    async def tell_draining(self, worker: str, on: bool) -> None:
        """Order the worker's guard to send GPU tasks back as they reach execution (or to
        run them again).

        distributed sends every GPU task to a valid worker at once; a worker restarting
        or quarantined would otherwise work through its queue. Only the worker knows which
        tasks it runs, so it turns the rest away itself (distributed's ``Reschedule``):
        nothing that finished is released, nothing runs twice. The guard confirms the
        order with the scheduler first; a worker without a guard works through its queue.
        """
        request = self.order(DRAIN_HANDLER, {"on": on})
        try:
            await getattr(self.scheduler.rpc(worker), DRAIN_HANDLER)(on=on, request=request)
        except Exception as exc:  # gone, or no guard
            logger.debug("accelsched: %s was not told to drain (%s): %r", worker, on, exc)
        finally:
            self.orders.forget(request)

    def confirm_order(
        self,
        comm: Any,
        request: str = "",
        fingerprint: str = "",
        worker: str = "",
        handler: str = "",
    ) -> ConfirmReply:
        """The scheduler's ``accelsched_confirm``: whether it sent this order (once).

        A worker asking about an order the scheduler never gave was sent a forged one:
        logged as ``request-refused`` for that worker (known workers only, so a stranger
        cannot grow the refusal table).
        """
        confirmed = self.orders.confirm(request, fingerprint)
        if not confirmed and worker in self.scheduler.workers:
            named = handler if handler in ORDERS else "unknown-order"  # not the caller's word
            self._refused_request(worker, named, str(getattr(comm, "peer_address", None)))
        return {"confirmed": confirmed}

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
