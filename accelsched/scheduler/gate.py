"""The verification gate: a worker's GPUs count only once its guard has verified them.

Workers register before their plugins run, so a declared ``GPU`` resource is live before
anything has checked it. The gate strips it at registration (:meth:`Gate.add_worker`),
grants devices when the worker's guard reports them (``accelsched_inventory``), keeps
one owner per GPU UUID (:class:`~accelsched.policy.ownership.OwnershipRegistry`), clamps
every later ``set_resources`` to the grant, takes a worker's GPUs out of placement while
it is quarantined, and offers ``no-worker`` tasks to a worker whose GPUs just arrived
(distributed does not). Unregistering the plugin puts declarations back.

Only a worker speaks for itself: every request names a worker and carries a one-time id,
which that worker must confirm (:mod:`accelsched.scheduler.authority`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from accelsched import events, internals
from accelsched.observe import metrics
from accelsched.policy.ownership import OwnershipRegistry
from accelsched.protocol import (
    CONFIRM_HANDLER,
    DRAIN_HANDLER,
    GPU,
    GUARD_PLUGIN,
    INVENTORY_HANDLER,
    OFFER_HANDLER,
    REPORT_HANDLER,
    DeviceRecord,
    InventoryReply,
    OfferReply,
)
from accelsched.scheduler.authority import Authority

if TYPE_CHECKING:
    from distributed import Scheduler
    from distributed.scheduler import WorkerState

__all__ = ["Gate"]

logger = logging.getLogger(__name__)

Emit = Callable[..., None]


class Gate:
    """Grants, ownership, declarations and quarantine, per worker address."""

    def __init__(self, *, share_gpus: bool, emit: Emit, active: Callable[[], bool]) -> None:
        self.scheduler: Scheduler | None = None
        self.registry = OwnershipRegistry(share=share_gpus)
        self.granted: dict[str, list[DeviceRecord]] = {}  # worker -> devices granted
        self.refused: dict[str, set[str]] = {}  # worker -> UUIDs it was refused
        self.declared: dict[str, float] = {}  # worker -> GPU count it registered with
        self.offered: dict[str, int] = {}  # worker -> granted GPUs its guard offers now
        self.authority = Authority(emit=emit)
        self.quarantined: dict[str, str] = {}  # worker -> reason
        self._emit = emit
        self._active = active

    # --- wiring ------------------------------------------------------------------------

    def start(self, scheduler: Scheduler) -> None:
        """Serve the inventory handler, gate ``set_resources``, strip every worker's GPUs.

        Guards already running report again now that someone listens (a guard registered
        later reports from its own setup).
        """
        self.scheduler = scheduler
        self.authority.scheduler = scheduler
        internals.install_handler(scheduler, INVENTORY_HANDLER, self.handle_inventory)
        internals.install_handler(scheduler, OFFER_HANDLER, self.handle_offer)
        internals.install_handler(scheduler, CONFIRM_HANDLER, self.authority.confirm_order)
        internals.wrap_set_resources(scheduler, self.set_resources)
        metrics.gpus_from(self.gpu_counts)
        for ws in list(scheduler.workers.values()):
            self.add_worker(ws)
        if internals.worker_plugin_registered(scheduler, GUARD_PLUGIN):
            for addr in list(scheduler.workers):
                internals.spawn(scheduler, self._ask_report, addr)

    def add_worker(self, ws: WorkerState) -> None:
        """The declared count does not count: nothing reaches the worker on its word.

        A worker that declared no GPU stays out of the ``GPU`` resource altogether (a
        ``GPU: 0`` entry would make it valid for ``resources={"GPU": 0}`` tasks, which its
        own state machine cannot run).
        """
        assert self.scheduler is not None
        if GPU not in ws.resources:
            return
        self.declared.setdefault(ws.address, ws.resources[GPU])
        internals.set_worker_gpus(self.scheduler, ws, self.allowed_gpus(ws.address))

    def stop(self) -> None:
        """The plugin was unregistered: distributed's handlers, and every worker's GPU
        count as it was declared."""
        assert self.scheduler is not None
        internals.remove_handler(self.scheduler, INVENTORY_HANDLER, self.handle_inventory)
        internals.remove_handler(self.scheduler, OFFER_HANDLER, self.handle_offer)
        internals.remove_handler(self.scheduler, CONFIRM_HANDLER, self.authority.confirm_order)
        internals.restore_set_resources(self.scheduler)
        metrics.stop_gpus(self.gpu_counts)
        for addr, count in self.declared.items():
            ws = self.scheduler.workers.get(addr)
            if ws is not None:
                internals.set_worker_gpus(self.scheduler, ws, count)
        self.declared.clear()

    def remove_worker(self, worker: str) -> None:
        """Free the worker's GPUs; workers refused one of them are asked to report again,
        so a GPU whose owner left does not sit unused."""
        assert self.scheduler is not None
        freed = set(self.registry.release(worker))
        self.refused.pop(worker, None)
        for other, uuids in list(self.refused.items()):
            if uuids & freed and other in self.scheduler.workers:
                internals.spawn(self.scheduler, self._ask_report, other)
        self.granted.pop(worker, None)
        self.declared.pop(worker, None)
        self.offered.pop(worker, None)
        self.quarantined.pop(worker, None)
        self.authority.forget(worker)

    async def _ask_report(self, addr: str) -> None:
        assert self.scheduler is not None
        try:
            await getattr(self.scheduler.rpc(addr), REPORT_HANDLER)()
        except Exception as exc:  # a worker without the GuardPlugin, or gone
            logger.debug("accelsched: %s did not report its GPUs: %r", addr, exc)

    # --- the inventory handler -----------------------------------------------------------

    async def handle_inventory(
        self,
        comm: Any,
        worker: str,
        devices: list[DeviceRecord],
        request: str = "",
        declared: float | None = None,
        requested: int = 0,
        reason: str | None = None,
    ) -> InventoryReply:
        """A guard reports the devices it verified and the count it asks for.

        Grants a subset when another worker owns some. Idempotent: a repeated, unchanged
        report changes nothing and logs nothing.
        """
        assert self.scheduler is not None
        if not self._active():
            return {"status": "no-plugin"}
        if worker not in self.scheduler.workers:
            return {"status": "unknown-worker"}
        said = dict(devices=devices, declared=declared, requested=requested, reason=reason)
        if not await self.authority.confirmed(comm, worker, request, INVENTORY_HANDLER, said):
            return {"status": "refused"}
        if worker not in self.scheduler.workers:  # it left while it was asked
            return {"status": "unknown-worker"}
        if isinstance(declared, (int, float)) and worker in self.declared:
            # the worker's own word on what it was started with: a gate registered after
            # an earlier one found the count that one had corrected
            self.declared[worker] = declared
        wanted = devices[:requested]
        previous = self.granted.get(worker)
        if (
            previous is not None
            and [d["uuid"] for d in previous] == [d["uuid"] for d in wanted]
            and not self.refused.get(worker)
        ):
            return self._reply(worker)
        granted_uuids, refused = self.registry.claim(worker, [d["uuid"] for d in wanted])
        granted = [d for d in wanted if d["uuid"] in granted_uuids]
        self.granted[worker] = granted
        self.refused[worker] = set(refused)
        if granted:
            self._emit(events.GPU_VERIFIED, worker, devices=granted, granted=len(granted))
        if refused:
            owners = sorted(set(refused.values()))
            self._emit(
                events.GPU_REJECTED,
                worker,
                uuids=sorted(refused),
                reason="owned",
                owner=owners[0] if len(owners) == 1 else owners,
            )
        if declared != len(granted) and (reason is not None or refused):
            self._emit(
                events.GPU_CORRECTED,
                worker,
                declared=declared,
                granted=len(granted),
                reason="owned" if refused else reason,
            )
        return self._reply(worker)

    def _reply(self, worker: str) -> InventoryReply:
        granted = [d["uuid"] for d in self.granted.get(worker, [])]
        return {"status": "OK", "uuids": granted, "token": self.authority.token_for(worker)}

    # --- the GPU count placement sees ------------------------------------------------------

    def allowed_gpus(self, worker: str) -> int:
        """The most GPUs ``worker`` may advertise now (0 while quarantined)."""
        if worker in self.quarantined:
            return 0
        return len(self.granted.get(worker, ()))

    def placed_gpus(self, worker: str) -> int:
        """The GPU count placement uses: what the guard offers, within the grant."""
        return min(self.offered.get(worker, 0), self.allowed_gpus(worker))

    async def handle_offer(
        self, comm: Any, worker: str, request: str = "", count: Any = 0
    ) -> OfferReply:
        """A guard offers ``count`` of its granted GPUs (fewer while one is withdrawn)."""
        scheduler = self.scheduler
        assert scheduler is not None
        if not self._active():
            return {"status": "no-plugin", "count": 0}
        if worker not in scheduler.workers:
            return {"status": "unknown-worker", "count": 0}
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            return {"status": "invalid", "count": 0}
        if not await self.authority.confirmed(
            comm, worker, request, OFFER_HANDLER, {"count": count}
        ):
            return {"status": "refused", "count": 0}
        ws = scheduler.workers.get(worker)
        if ws is None:
            return {"status": "unknown-worker", "count": 0}
        self.offered[worker] = count
        self._place(ws)
        return {"status": "OK", "count": self.placed_gpus(worker)}

    def _place(self, ws: WorkerState) -> None:
        """Set the worker's GPU count to :meth:`placed_gpus`; offer or send back tasks."""
        scheduler = self.scheduler
        assert scheduler is not None
        if not (after := self.placed_gpus(ws.address)) and GPU not in ws.resources:
            return  # never declared, nothing granted: stays out of the GPU resource
        before = ws.resources.get(GPU, 0)
        internals.set_worker_gpus(scheduler, ws, after)
        if after > before:  # waiting tasks, and its share of its peers' queues
            internals.offer_unrunnable(scheduler, ws)
            internals.take_share(scheduler, ws)
        elif after < before:  # a device withdrawn: what no longer fits goes elsewhere
            internals.release_unfit(scheduler, ws, after)

    def set_resources(
        self, original: Callable[..., Any], worker: str, resources: dict | None
    ) -> Any:
        """distributed's ``set_resources`` handler; the GPU figure is the gate's own.

        Anyone can call ``set_resources`` naming any worker, so a ``GPU`` value in it
        counts for nothing: placement uses what the worker's guard offered (confirmed)
        within its grant. Other resources pass through.
        """
        scheduler = self.scheduler
        assert scheduler is not None
        ws = scheduler.workers.get(worker)
        if ws is None or not self._active():  # unregistered: distributed's own behaviour
            return original(worker=worker, resources=resources)
        resources = dict(resources or {})
        resources.pop(GPU, None)
        if GPU in ws.resources:
            resources[GPU] = ws.resources[GPU]  # kept as the gate set it
        result = internals.apply_resources(original, scheduler, worker, resources)
        self._place(ws)
        return result

    def quarantine(self, worker: str, reason: str) -> None:
        """Take the worker's GPUs out of placement; GPU tasks go elsewhere or fall back."""
        assert self.scheduler is not None
        ws = self.scheduler.workers.get(worker)
        if ws is None or worker in self.quarantined:
            return
        self.quarantined[worker] = reason
        if GPU in ws.resources:
            internals.set_worker_gpus(self.scheduler, ws, 0)
        # GPU tasks already sent to it (a queue of them, often) go elsewhere too
        internals.spawn(self.scheduler, self.tell_draining, worker, True)
        self._emit(events.QUARANTINE, worker, reason=reason)

    async def tell_draining(self, worker: str, on: bool) -> None:
        """Tell the worker's guard to send GPU tasks back as they reach execution (or to
        run them again).

        distributed sends every GPU task to a valid worker at once; a worker restarting
        or quarantined would otherwise work through its queue. Only the worker knows which
        tasks it runs, so it turns the rest away itself (distributed's ``Reschedule``):
        nothing that finished is released, nothing runs twice. The guard confirms the
        order with the scheduler first; a worker without a guard works through its queue.
        """
        assert self.scheduler is not None
        request = self.authority.order(DRAIN_HANDLER, {"on": on})
        try:
            await getattr(self.scheduler.rpc(worker), DRAIN_HANDLER)(on=on, request=request)
        except Exception as exc:  # gone, or no guard
            logger.debug("accelsched: %s was not told to drain (%s): %r", worker, on, exc)
        finally:
            self.authority.orders.forget(request)

    def gpu_counts(self) -> tuple[int, int]:
        """(GPUs placement may use, GPUs of quarantined workers): the metrics gauge."""
        granted = {w: len(d) for w, d in self.granted.items()}
        quarantined = sum(granted.get(w, 0) for w in self.quarantined)
        return sum(granted.values()) - quarantined, quarantined
