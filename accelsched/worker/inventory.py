"""The worker's verified inventory and what it says to the scheduler about itself.

At setup the guard probes the devices through NVML (MIG devices included, as CUDA
enumerates them: :mod:`accelsched.devices.visible`), decides which this worker owns
(:func:`accelsched.policy.ownership.owned`) and how many it asks for
(:func:`accelsched.policy.ownership.decide_claim`), reports them (``accelsched_inventory``) and
advertises only what the scheduler granted. Later it may ask for its own restart
(``accelsched_restart``). Each request carries a one-time id the scheduler checks by
calling this worker back (``accelsched_confirm``): only this process can confirm it.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Callable, Mapping
from time import monotonic
from typing import TYPE_CHECKING, Any

from accelsched import internals
from accelsched.devices.nvml import DeviceInfo, NVMLMonitor
from accelsched.events import TOPIC
from accelsched.policy.ownership import Claim, decide_claim, declared_count, owned
from accelsched.policy.requests import Outstanding, fingerprint
from accelsched.policy.requirements import capacity, mebibytes
from accelsched.protocol import (
    CONFIRM_HANDLER,
    DRAIN_HANDLER,
    EVENT_OP,
    INVENTORY_HANDLER,
    OFFER_HANDLER,
    RESTART_HANDLER,
    ConfirmReply,
    InventoryReply,
    InventoryRequest,
    OfferRequest,
    ReportReply,
    RestartReply,
    RestartRequest,
    RestartStatus,
    request_content,
)

if TYPE_CHECKING:
    from distributed import Worker

__all__ = ["Inventory", "under_dask_cuda"]

logger = logging.getLogger(__name__)

#: Replies to a restart request saying the scheduler is restarting this worker.
TAKEN: frozenset[RestartStatus] = frozenset({"accepted", "in-flight"})
#: Seconds not to ask again after such a reply: a restart is over in well under this
#: (about 0.2 s with fast restarts; a drain waiting for a long task answers "in-flight"
#: again), and one that was given up is asked for again after it.
RESTART_TAKEN_HOLD = 5.0


class Inventory:
    """Devices visible, owned and granted; the requests this worker has outstanding."""

    def __init__(self, *, advertise_undeclared: bool) -> None:
        self.advertise_undeclared = advertise_undeclared
        self.worker: Worker | None = None
        self.monitor: NVMLMonitor | None = None
        self.visible: list[DeviceInfo] = []
        self.owned: list[DeviceInfo] = []
        self.granted: list[DeviceInfo] = []  # what the scheduler granted (placement uses)
        self.withdrawn: set[int] = set()  # granted, but failing NVML: not offered
        self.claim = Claim(0, None)  # what this worker asks for
        self.declared: object = None  # as the worker was started: maybe no number at all
        self.pending = Outstanding()  # requests this worker sent, unconfirmed
        self.restart_pending = False
        #: Until when (monotonic) not to ask again for the same reason: the scheduler
        #: took the last request and is replacing this process (asked now, it could not
        #: answer the call back). Another reason (a GPU failing, asked for once) is sent.
        self.restart_taken_until = 0.0
        self.restart_taken_for = ""
        self.draining = False  # the scheduler restarts this worker: GPU tasks go back
        self._offering = asyncio.Lock()
        #: What this worker's events carry (the PlacementPlugin's word for it): None
        #: until a report was answered, "" where no PlacementPlugin answered.
        self.token: str | None = None
        self._early: list[dict[str, Any]] = []  # events from before that answer

    def probe(self, worker: Worker) -> None:
        """Read the devices through NVML and decide what to claim (no scheduler yet)."""
        self.worker = worker
        self.declared = internals.declared_gpus(worker)
        self.monitor = NVMLMonitor()
        self.visible = self.monitor.devices()
        self.owned = owned(self.visible, under_dask_cuda=under_dask_cuda(worker))
        self.claim = decide_claim(
            self.declared, len(self.owned), advertise_undeclared=self.advertise_undeclared
        )

    def rejoin(self, device: DeviceInfo) -> None:
        """A device left out at :meth:`probe` answers steadily again: list it, and own
        and claim it as if it had answered then (the next :meth:`report` says so)."""
        assert self.monitor is not None and self.worker is not None
        self.monitor.adopt(device)
        # in place: the guard's parts hold these lists
        self.visible[:] = list(self.monitor.devices())
        self.owned[:] = owned(self.visible, under_dask_cuda=under_dask_cuda(self.worker))
        self.claim = decide_claim(
            self.declared, len(self.owned), advertise_undeclared=self.advertise_undeclared
        )

    async def report(self, on_granted: Callable[[list[int]], None]) -> ReportReply:
        """Report the owned devices and advertise what the scheduler granted.

        ``on_granted`` receives the CUDA indices granted, before the worker advertises
        them, so no GPU task can start before its devices are known.
        """
        worker = self.worker
        assert worker is not None
        request: InventoryRequest = {
            "worker": str(worker.contact_address),
            "request": "",
            "devices": [d.as_dict() for d in self.owned],
            "declared": declared_count(self.declared),
            "requested": self.claim.count,
            "reason": self.claim.reason,
        }
        request["request"] = self._new_request(INVENTORY_HANDLER, request)
        reply: InventoryReply | None
        try:
            reply = await getattr(worker.scheduler, INVENTORY_HANDLER)(**request)
        except Exception as exc:
            logger.info("accelsched: GPU report to the scheduler failed: %r", exc)
            reply = None
        finally:
            self.pending.forget(request["request"])
        if isinstance(reply, dict) and reply.get("status") == "OK":
            granted = set(reply.get("uuids", ()))
            self._events_go(str(reply.get("token") or ""))
        elif reply is None:
            self._events_go("")
            # No PlacementPlugin: nothing enforces placement, but the worker still
            # advertises only what it owns.
            logger.warning(
                "accelsched: no PlacementPlugin on the scheduler (handler %r missing); "
                "correcting this worker's GPU count without verification. Placement is "
                "not enforced: start the scheduler with --preload accelsched or call "
                "accelsched.register(client)",
                INVENTORY_HANDLER,
            )
            granted = {d.uuid for d in self.owned[: self.claim.count]}
        else:
            return {"status": str(reply.get("status") if isinstance(reply, dict) else reply)}
        self.granted = [d for d in self.owned if d.uuid in granted]
        return {"status": "OK", "devices": await self.offer(on_granted)}

    def send_event(self, msg: dict[str, Any]) -> None:
        """Send one event to the scheduler's log (from any thread).

        With a PlacementPlugin: on this worker's own stream, with the token it gave this
        worker, so task code cannot log accelsched events in any worker's name (the
        scheduler drops the topic from ``Worker.log_event``). Without one (an older
        scheduler, or none registered): through ``Worker.log_event``, as any event.
        Events from before the first answer wait for it (a few at most).
        """
        worker = self.worker
        assert worker is not None
        if self.token:
            internals.send_to_scheduler(worker, EVENT_OP, msg=msg, token=self.token)
        elif self.token == "":
            worker.log_event(TOPIC, msg)
        elif len(self._early) < 64:
            self._early.append(msg)

    def _events_go(self, token: str) -> None:
        self.token = token
        early, self._early = self._early, []
        for msg in early:
            self.send_event(msg)

    async def offer(self, on_usable: Callable[[list[int]], None]) -> list[int]:
        """Advertise the granted devices that are not withdrawn; returns their indices.

        ``on_usable`` receives them first, so no GPU task starts before its devices are
        known, and none is leased a withdrawn device.
        """
        async with self._offering:  # one at a time: the latest state is the last said
            return await self._offer(on_usable)

    async def _offer(self, on_usable: Callable[[list[int]], None]) -> list[int]:
        worker = self.worker
        assert worker is not None
        usable = [d.index for d in self.granted if d.index not in self.withdrawn]
        on_usable(usable)
        request: OfferRequest = {
            "worker": str(worker.contact_address),
            "request": "",
            "count": len(usable),
        }
        request["request"] = self._new_request(OFFER_HANDLER, request)
        try:
            await getattr(worker.scheduler, OFFER_HANDLER)(**request)
        except Exception as exc:  # no PlacementPlugin: the worker's own count only
            logger.debug("accelsched: GPU offer to the scheduler failed: %r", exc)
        finally:
            self.pending.forget(request["request"])
        if usable or self.granted or internals.advertises_gpus(worker):
            memory = sum(mebibytes(capacity(d.memory)) for d in self.granted if d.index in usable)
            await internals.set_own_gpus(worker, len(usable), memory)
        return usable

    def ask_restart(self, reason: str, nbytes: int) -> None:
        """Ask the scheduler, once at a time, to restart this worker without loss."""
        if self.restart_pending or (
            reason == self.restart_taken_for and monotonic() < self.restart_taken_until
        ):
            return
        assert self.worker is not None
        try:
            internals.spawn(self.worker, self._request_restart, reason, nbytes)
        except Exception as exc:  # the worker is closing: nothing to restart
            logger.info("accelsched: restart request not sent: %r", exc)
        else:
            self.restart_pending = True

    async def _request_restart(self, reason: str, nbytes: int) -> None:
        worker = self.worker
        assert worker is not None
        request: RestartRequest = {
            "worker": str(worker.contact_address),
            "request": "",
            "reason": reason,
            "nbytes": nbytes,
        }
        request["request"] = self._new_request(RESTART_HANDLER, request)
        try:
            reply: RestartReply = await getattr(worker.scheduler, RESTART_HANDLER)(**request)
            logger.info("accelsched: restart request answered %r", reply)
            if isinstance(reply, dict) and reply.get("status") in TAKEN:
                # a restart that is given up (no peer to take the data, say) is asked
                # for again after this: the leak is still there
                self.restart_taken_until = monotonic() + RESTART_TAKEN_HOLD
                self.restart_taken_for = reason
        except Exception as exc:
            # a worker being replaced loses this call with its process: nothing to say
            log = logger.warning if internals.worker_in_service(worker) else logger.debug
            log("accelsched: restart request (%s) failed: %r", RESTART_HANDLER, exc)
        finally:
            self.pending.forget(request["request"])
            self.restart_pending = False

    def _new_request(self, handler: str, request: Mapping[str, Any]) -> str:
        return self.pending.new(handler, request_content(request))

    async def drain(self, on: Any = True, request: str = "") -> dict[str, str]:
        """``accelsched_drain``: while this worker restarts, send GPU tasks back as they
        reach execution (its queue is placed elsewhere; only what runs is waited for).

        Only the scheduler may order it: the order is confirmed with the scheduler first
        (before, anyone could make a worker bounce every GPU task back, forever)."""
        if not isinstance(on, bool):
            return {"status": "invalid"}
        if not await self.ordered(DRAIN_HANDLER, request, {"on": on}):
            logger.warning("accelsched: refused a drain order the scheduler did not send")
            return {"status": "refused"}
        self.draining = on
        return {"status": "OK"}

    async def ordered(self, handler: str, request: Any, content: Mapping[str, Any]) -> bool:
        """Whether the scheduler itself sent this order: asked back, as it asks us."""
        worker = self.worker
        assert worker is not None
        if not isinstance(request, str) or not request:
            return False
        try:
            reply = await getattr(worker.scheduler, CONFIRM_HANDLER)(
                request=request,
                fingerprint=fingerprint(handler, content),
                worker=str(worker.contact_address),
                handler=handler,
            )
        except Exception as exc:  # no PlacementPlugin, or the scheduler is gone
            logger.debug("accelsched: could not confirm a %s order: %r", handler, exc)
            return False
        return isinstance(reply, dict) and reply.get("confirmed") is True

    def confirm(self, request: str = "", fingerprint: str = "") -> ConfirmReply:
        """``accelsched_confirm``: whether this worker sent ``request``, saying what
        ``fingerprint`` stands for, and awaits it; confirmed once."""
        return {"confirmed": self.pending.confirm(request, fingerprint)}


def under_dask_cuda(worker: Any) -> bool:
    """True for workers started by dask-cuda (LocalCUDACluster, ``dask cuda worker``).

    dask-cuda gives its workers plugins of its own (CPU affinity, RMM setup, ...), and
    only then is ``dask_cuda`` imported in the worker process.
    """
    if "dask_cuda" not in sys.modules:
        return False
    return any(m.startswith("dask_cuda") for m in internals.plugin_modules(worker))
