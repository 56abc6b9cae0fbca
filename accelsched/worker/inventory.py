"""The worker's verified inventory and what it says to the scheduler about itself.

At setup the guard probes the devices through NVML (MIG devices included, as CUDA
enumerates them: :mod:`accelsched.devices.nvml`), decides which this worker owns
(:func:`accelsched.policy.ownership.owned`) and how many it asks for
(:func:`accelsched.policy.ownership.decide_claim`), reports them (``accelsched_inventory``) and
advertises only what the scheduler granted. Later it may ask for its own restart
(``accelsched_restart``). Each request names this process and carries an id it never
uses again, so the scheduler acts on it once and never on behalf of a process that took
this address since (:mod:`accelsched.policy.requests`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import sys
from collections.abc import Callable
from time import monotonic
from typing import TYPE_CHECKING, Any

from accelsched import internals
from accelsched.devices.nvml import DeviceInfo, NVMLMonitor
from accelsched.policy.leak import DeviceHealth
from accelsched.policy.ownership import Claim, decide_claim, declared_count, owned
from accelsched.policy.requirements import capacity, held_counted, mebibytes
from accelsched.protocol import (
    INVENTORY_HANDLER,
    OFFER_HANDLER,
    RESTART_HANDLER,
    Addressed,
    InventoryReply,
    InventoryRequest,
    OfferRequest,
    ReportReply,
    RestartReply,
    RestartRequest,
    RestartStatus,
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
    """Devices visible, owned and granted; what this worker says to the scheduler."""

    def __init__(self, worker: Worker, *, advertise_undeclared: bool, interval: float) -> None:
        """Read the devices through NVML and decide what to claim (no scheduler yet)."""
        self.advertise_undeclared = advertise_undeclared
        self.worker = worker
        self.declared: object = internals.declared_gpus(worker)  # maybe no number at all
        self.monitor = NVMLMonitor()
        self.visible: list[DeviceInfo] = []
        self.owned: list[DeviceInfo] = []
        self.claim = Claim(0, None)  # what this worker asks for
        self._take(self.monitor.devices())
        self.granted: list[DeviceInfo] = []  # what the scheduler granted (placement uses)
        #: Which devices fail NVML (withdrawn: not offered) or were left out, shared with
        #: the parts that judge their answers. Left-out devices are probed at the check's
        #: pace while they answer, at most every 30 s while they do not.
        self.health = DeviceHealth(first=interval, longest=max(interval, 30.0))
        self._ids = itertools.count()  # request ids: this process uses each once
        self.restart_pending = False
        #: Until when (monotonic) not to ask again for the same reason: the scheduler
        #: took the last request and is replacing this process (asking again would only
        #: be answered "in-flight"). Another reason (a GPU failing, asked for once) is sent.
        self.restart_taken_until = 0.0
        self.restart_taken_for = ""
        self.draining = False  # the scheduler restarts this worker: GPU tasks go back
        self._offering = asyncio.Lock()
        #: bytes the results in this worker's memory hold on a device (the ledger's)
        self.held: Callable[[int], int] = lambda device: 0
        #: device -> bytes its declared tasks may take there, as the scheduler divided a
        #: shared device (learnt from the offer reply; none: the capacity)
        self.shares: dict[int, int] = {}
        self.held_said: dict[int, int] = {}  # device -> held bytes last offered, in steps

    def _take(self, visible: list[DeviceInfo]) -> None:
        """List ``visible``, own and claim as the policy says (in place: the guard's
        parts hold these lists)."""
        self.visible[:] = visible
        self.owned[:] = owned(self.visible, under_dask_cuda=under_dask_cuda(self.worker))
        self.claim = decide_claim(
            self.declared, len(self.owned), advertise_undeclared=self.advertise_undeclared
        )

    def rejoin(self, device: DeviceInfo) -> None:
        """A device left out at setup answers steadily again: list it, and own and claim
        it as if it had answered then (the next :meth:`report` says so)."""
        self.monitor.adopt(device)
        self._take(list(self.monitor.devices()))

    async def report(self, on_granted: Callable[[list[int]], None]) -> ReportReply:
        """Report the owned devices and advertise what the scheduler granted.

        ``on_granted`` receives the CUDA indices granted, before the worker advertises
        them, so no GPU task can start before its devices are known.
        """
        request: InventoryRequest = {
            **self._addressed(),
            "devices": [d.as_dict() for d in self.owned],
            "declared": declared_count(self.declared),
            "requested": self.claim.count,
            "reason": self.claim.reason,
        }
        reply: InventoryReply | None
        try:
            reply = await getattr(self.worker.scheduler, INVENTORY_HANDLER)(**request)
        except Exception as exc:
            logger.info("accelsched: GPU report to the scheduler failed: %r", exc)
            reply = None
        if isinstance(reply, dict) and reply.get("status") == "OK":
            granted = set(reply.get("uuids", ()))
        elif reply is None:
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

    @property
    def usable(self) -> list[int]:
        """The granted devices not withdrawn (as the health record says)."""
        withdrawn = self.health.withdrawn
        return [d.index for d in self.granted if d.index not in withdrawn]

    async def offer(self, on_usable: Callable[[list[int]], None]) -> list[int]:
        """Advertise the granted devices that are not withdrawn; returns their indices.

        ``on_usable`` receives them first, so no GPU task starts before its devices are
        known, and none is leased a withdrawn device.
        """
        worker = self.worker
        async with self._offering:  # one at a time: the latest state is the last said
            usable = self.usable
            on_usable(usable)
            offered = [d for d in self.granted if d.index in usable]
            self.held_said = self.held_in_steps()
            request: OfferRequest = {
                **self._addressed(),
                "count": len(usable),
                "uuids": [d.uuid for d in offered],
                "held": {d.uuid: self.held_said.get(d.index, 0) for d in offered},
            }
            reply = None
            try:
                reply = await getattr(worker.scheduler, OFFER_HANDLER)(**request)
            except Exception as exc:  # no PlacementPlugin: the worker's own count only
                logger.debug("accelsched: GPU offer to the scheduler failed: %r", exc)
            if isinstance(reply, dict) and reply.get("status") == "OK" and "memory" in reply:
                by_uuid = {d.uuid: d.index for d in offered}
                shares = {by_uuid[u]: n for u, n in reply.get("shares", {}).items() if u in by_uuid}
                memory = reply["memory"]
            else:  # its own devices' capacity, less what results hold
                shares = {}
                memory = sum(
                    mebibytes(max(0, capacity(d.memory) - self.held_said.get(d.index, 0)))
                    for d in offered
                )
            if shares != self.shares:  # packed within them from now on
                self.shares = shares
                on_usable(usable)
            if self.granted or internals.advertises_gpus(worker):  # usable: granted ones
                await internals.set_own_gpus(worker, len(usable), memory)
            return usable

    def held_in_steps(self) -> dict[int, int]:
        """What results hold on each granted device, as offered: in steps of a
        sixteenth of it (:func:`~accelsched.policy.requirements.held_counted`)."""
        return {d.index: held_counted(self.held(d.index), d.memory) for d in self.granted}

    def results_moved(self) -> bool:
        """Whether what results hold changed by a step on some device since the last
        offer said it (then the guard offers again)."""
        return bool(self.granted) and self.held_in_steps() != self.held_said

    def ask_restart(self, reason: str, nbytes: int) -> None:
        """Ask the scheduler, once at a time, to restart this worker without loss."""
        if self.restart_pending or (
            reason == self.restart_taken_for and monotonic() < self.restart_taken_until
        ):
            return
        try:
            internals.spawn(self.worker, self._request_restart, reason, nbytes)
        except Exception as exc:  # the worker is closing: nothing to restart
            logger.info("accelsched: restart request not sent: %r", exc)
        else:
            self.restart_pending = True

    async def _request_restart(self, reason: str, nbytes: int) -> None:
        worker = self.worker
        request: RestartRequest = {**self._addressed(), "reason": reason, "nbytes": nbytes}
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
            self.restart_pending = False

    def _addressed(self) -> Addressed:
        """Whom a request speaks for: this worker's address, this process, a new id."""
        return {
            "worker": str(self.worker.contact_address),
            "process": str(self.worker.id),
            "request": str(next(self._ids)),
        }

    def drain(self, on: Any = True, process: Any = "") -> dict[str, str]:
        """``accelsched_drain``: while this worker restarts, send GPU tasks back as they
        reach execution (its queue is placed elsewhere; only what runs is waited for).

        An order meant for another process (one this address had before) is refused:
        a fresh worker must not bounce its GPU tasks for its predecessor's restart."""
        if not isinstance(on, bool):
            return {"status": "invalid"}
        if process != self.worker.id:
            logger.warning("accelsched: refused a drain order meant for process %r", process)
            return {"status": "refused"}
        self.draining = on
        return {"status": "OK"}


def under_dask_cuda(worker: Any) -> bool:
    """True for workers started by dask-cuda (LocalCUDACluster, ``dask cuda worker``).

    dask-cuda gives its workers plugins of its own (CPU affinity, RMM setup, ...), and
    only then is ``dask_cuda`` imported in the worker process.
    """
    if "dask_cuda" not in sys.modules:
        return False
    return any(m.startswith("dask_cuda") for m in internals.plugin_modules(worker))
