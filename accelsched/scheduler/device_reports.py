"""What the guards report about their devices: ``accelsched_inventory`` and ``accelsched_offer``.

A worker's guard reports the devices it verified and the count it asks for; this part
grants what nobody else owns (:class:`~accelsched.scheduler.grants.Grants`), logs the
verdict (``gpu-verified``, ``gpu-rejected``, ``gpu-corrected``) and answers with the UUIDs
granted. Later the guard offers how many of them it can serve now (fewer while one is
withdrawn), and placement follows (below).

Every request from a worker (these two, and ``accelsched_restart``) is acted on only if
the process it comes from is the one the scheduler holds at the address it names, and
only once per id (:class:`~accelsched.policy.requests.Requests`; :meth:`DeviceReports.admits`):
a late request from a process since replaced, or one replayed, is refused and logged as a
``request-refused`` event. The threat model is distributed's (docs/architecture.md):
anyone connected is trusted; what is guarded against are accidents. When a worker
leaves, the workers refused one of its GPUs are asked to report again, so a GPU whose
owner left does not sit unused.

Each worker's ``GPU`` count in distributed's placement is what :class:`Grants` allows. A
declared ``GPU`` resource is live in distributed before anything has checked it, and
anyone can call ``set_resources`` naming any worker. So the count is stripped at
registration, set within the grant whenever the worker's guard offers (or anyone calls
``set_resources``), zero while the worker is quarantined, and back to the declaration when
the plugin is unregistered. A worker whose count grows is offered the ``no-worker`` tasks
(distributed does not); one whose count shrinks sends back what no longer fits.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from accelsched import display, events, internals
from accelsched.policy.requests import Requests
from accelsched.protocol import (
    GPU,
    GPU_MEMORY,
    GUARD_PLUGIN,
    INVENTORY_HANDLER,
    OFFER_HANDLER,
    REPORT_HANDLER,
    DeviceRecord,
    InventoryReply,
    OfferReply,
    report_problem,
)
from accelsched.scheduler.grants import Grants

if TYPE_CHECKING:
    from distributed import Scheduler
    from distributed.scheduler import WorkerState

__all__ = ["DeviceReports"]

logger = logging.getLogger(__name__)


class DeviceReports:
    """Serves the inventory and offer handlers; asks guards to report; sets the GPU count
    of every worker from its grant; serves the GPU gauge."""

    def __init__(
        self,
        scheduler: Scheduler,
        *,
        grants: Grants,
        emit: Callable[..., None],
        active: Callable[[], bool],
        gained: Callable[[str], None],
    ) -> None:
        """Gate ``set_resources``, serve the gauge, strip every worker's declared GPUs.

        ``gained(worker)``: the worker's devices were granted (tasks with requirements
        it meets gain it)."""
        self.scheduler = scheduler
        self._grants = grants
        self._requests = Requests()
        self._emit = emit
        self._active = active
        self._gained = gained
        internals.wrap_handler(scheduler, "set_resources", self.set_resources)
        display.gpus_from(self._grants.gauge)
        for ws in list(scheduler.workers.values()):
            self.add_worker(ws)

    def start(self) -> None:
        """Serve the handlers. Guards already running report again now that someone
        listens (a guard registered later reports from its own setup)."""
        scheduler = self.scheduler
        internals.install_handler(scheduler, INVENTORY_HANDLER, self.handle_inventory)
        internals.install_handler(scheduler, OFFER_HANDLER, self.handle_offer)
        if internals.worker_plugin_registered(scheduler, GUARD_PLUGIN):
            for addr in list(scheduler.workers):
                internals.spawn(scheduler, self._ask_report, addr)

    def stop(self) -> None:
        """Unregistered: distributed's handlers and ``set_resources``, and every worker's
        GPU count as it was declared."""
        internals.remove_handler(self.scheduler, INVENTORY_HANDLER, self.handle_inventory)
        internals.remove_handler(self.scheduler, OFFER_HANDLER, self.handle_offer)
        internals.restore_handler(self.scheduler, "set_resources")
        self.close()
        for addr, count in self._grants.take_declarations().items():
            ws = self.scheduler.workers.get(addr)
            if ws is not None:
                internals.set_worker_gpus(self.scheduler, ws, count)

    def close(self) -> None:
        """The gauge no longer reads these grants."""
        display.stop_gpus(self._grants.gauge)

    def remove_worker(self, worker: str) -> None:
        """Free the worker's GPUs (workers refused one of them, or sharing one, are asked
        to report again: they may claim it, or take a larger share of it); the request
        ids of its process go with it."""
        self._requests.forget(worker)
        sharers = self._grants.sharers(worker)
        for other in sorted(sharers.union(self._grants.remove(worker))):
            self._reshare(other)

    def _reshare(self, worker: str) -> None:
        """``worker``'s share of a device changed (a sharer joined or left): place
        against it now, and ask its guard to report, learning it from the offer reply."""
        if (ws := self.scheduler.workers.get(worker)) is not None:
            if self._grants.reported(worker):
                self.place(ws)
            internals.spawn(self.scheduler, self._ask_report, worker)

    def admits(self, worker: str, process: Any, request: Any, handler: str) -> bool:
        """Whether to act on ``request`` to ``handler``, naming ``worker``, from
        ``process`` (a worker unknown here: no, and no event; its handler says so)."""
        ws = self.scheduler.workers.get(worker)
        registered = None if ws is None else ws.server_id
        refusal = self._requests.refusal(worker, process, registered, request)
        if refusal is not None and ws is not None:
            self._emit(events.REQUEST_REFUSED, worker, handler=handler, reason=refusal)
        return refusal is None

    async def _ask_report(self, addr: str) -> None:
        try:
            await getattr(self.scheduler.rpc(addr), REPORT_HANDLER)()
        except Exception as exc:  # a worker without the GuardPlugin, or gone
            logger.debug("accelsched: %s did not report its GPUs: %r", addr, exc)

    # --- the inventory handler -----------------------------------------------------------

    def handle_inventory(
        self,
        comm: Any,
        worker: str,
        devices: list[DeviceRecord],
        process: str = "",
        request: str = "",
        declared: float | None = None,
        requested: int = 0,
        reason: str | None = None,
    ) -> InventoryReply:
        """A guard reports the devices it verified and the count it asks for.

        Grants a subset when another worker owns some. Idempotent: a repeated, unchanged
        report changes nothing and logs nothing.
        """
        if not self._active():
            return {"status": "no-plugin"}
        if worker not in self.scheduler.workers:
            return {"status": "unknown-worker"}
        if not self.admits(worker, process, request, INVENTORY_HANDLER):
            return {"status": "refused"}
        if (problem := report_problem(devices, requested)) is not None:  # nothing granted
            logger.warning("accelsched: refused the GPU report of %s: %s", worker, problem)
            return {"status": "refused"}
        if isinstance(declared, (int, float)):
            self._grants.correct_declaration(worker, declared)
        if (claimed := self._grants.claim(worker, devices[:requested])) is None:
            return {"status": "OK", "uuids": self._grants.uuids(worker)}  # a repeat
        granted, refused = claimed
        for other in sorted(self._grants.sharers(worker)):  # its share of theirs is less now
            self._reshare(other)
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
        return {"status": "OK", "uuids": self._grants.uuids(worker)}

    # --- the offer handler -----------------------------------------------------------------

    def handle_offer(
        self,
        comm: Any,
        worker: str,
        process: str = "",
        request: str = "",
        count: Any = 0,
        uuids: Any = None,
        held: Any = None,
    ) -> OfferReply:
        """A guard offers ``count`` of its granted GPUs (fewer while one is withdrawn):
        those of ``uuids``, whose results hold ``held`` bytes on each. The reply says
        the share of each device its declared tasks may take."""
        if not self._active():
            return {"status": "no-plugin", "count": 0}
        ws = self.scheduler.workers.get(worker)
        if ws is None:
            return {"status": "unknown-worker", "count": 0}
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            return {"status": "invalid", "count": 0}
        if uuids is not None and not (  # a list sent, a tuple as distributed's msgpack reads it
            isinstance(uuids, (list, tuple)) and all(isinstance(u, str) for u in uuids)
        ):
            return {"status": "invalid", "count": 0}
        if uuids is not None and (
            len(set(uuids)) != count or not set(uuids) <= set(self._grants.uuids(worker))
        ):  # the devices it names are granted ones, as many as it offers
            return {"status": "invalid", "count": 0}
        if held is not None and not (
            isinstance(held, dict)
            and all(isinstance(u, str) and type(n) is int and n >= 0 for u, n in held.items())
        ):
            return {"status": "invalid", "count": 0}
        if not self.admits(worker, process, request, OFFER_HANDLER):
            return {"status": "refused", "count": 0}
        self._grants.offer(worker, count, None if uuids is None else list(uuids), held)
        self.place(ws)
        placed = self._grants.placed(worker)
        shares, memory = self._grants.shares(worker, placed)
        return {"status": "OK", "count": placed, "shares": shares, "memory": memory}

    # --- the GPU count placement uses ----------------------------------------------------

    def add_worker(self, ws: WorkerState) -> None:
        """The declared count does not count: nothing reaches the worker on its word.

        A worker that declared no GPU stays out of the ``GPU`` resource altogether (a
        ``GPU: 0`` entry would make it valid for ``resources={"GPU": 0}`` tasks, which its
        own state machine cannot run).
        """
        if GPU not in ws.resources:
            return
        self._grants.declare(ws.address, ws.resources[GPU])
        internals.set_worker_gpus(self.scheduler, ws, self._grants.placed(ws.address))

    def place(self, ws: WorkerState) -> None:
        """Set the worker's GPU count to what its grant places; offer or send back tasks."""
        scheduler = self.scheduler
        if not (after := self._grants.placed(ws.address)) and GPU not in ws.resources:
            return  # never declared, nothing granted: stays out of the GPU resource
        before = ws.resources.get(GPU, 0)
        had = ws.resources.get(GPU_MEMORY, 0)
        internals.set_worker_gpus(scheduler, ws, after)
        # declared-memory tasks take GPU-memory: the offered devices' shares (their
        # capacity, divided among the workers sharing one) less what results hold
        memory = self._grants.shares(ws.address, after)[1]
        internals.set_worker_gpus(scheduler, ws, memory, GPU_MEMORY)
        if after > before:  # waiting tasks, and its share of its peers' queues
            self._gained(ws.address)  # tasks with requirements it meets
            internals.offer_unrunnable(scheduler, ws)
            internals.take_share(scheduler, ws)
        elif after < before or memory < had:  # what no longer fits goes elsewhere
            internals.release_unfit(scheduler, ws)
        if after == before and memory > had:  # results released, a sharer left
            internals.offer_unrunnable(scheduler, ws)

    def zero(self, ws: WorkerState) -> None:
        """No GPU task is placed on ``ws`` any more (quarantine); what it was sent already
        is its guard's to send back, as it reaches execution."""
        if GPU in ws.resources:
            internals.set_worker_gpus(self.scheduler, ws, 0)
        if GPU_MEMORY in ws.resources:
            internals.set_worker_gpus(self.scheduler, ws, 0, GPU_MEMORY)

    def set_resources(
        self, original: Callable[..., Any], worker: str, resources: dict | None = None
    ) -> Any:
        """distributed's ``set_resources`` handler; the GPU figure is the grant's.

        Anyone can call ``set_resources`` naming any worker, so a ``GPU`` value in it
        counts for nothing: placement uses what the worker's guard offered (confirmed)
        within its grant. Other resources pass through.
        """
        scheduler = self.scheduler
        ws = scheduler.workers.get(worker)
        if ws is None or not self._active():  # unregistered: distributed's own behaviour
            return original(worker=worker, resources=resources)
        resources = dict(resources or {})
        for name in (GPU, GPU_MEMORY):
            resources.pop(name, None)
            if name in ws.resources:
                resources[name] = ws.resources[name]  # kept as this part set it
        result = internals.apply_resources(original, scheduler, worker, resources)
        self.place(ws)
        return result
