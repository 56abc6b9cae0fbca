"""What the guards report about their devices: ``accelsched_inventory`` and ``accelsched_offer``.

A worker's guard reports the devices it verified and the count it asks for; this part
grants what nobody else owns (:class:`~accelsched.scheduler.grants.Grants`), logs the
verdict (``gpu-verified``, ``gpu-rejected``, ``gpu-corrected``) and answers with the UUIDs
granted. Later the guard offers how many of them it can serve now (fewer while one is
withdrawn), and placement follows (:class:`~accelsched.scheduler.gpu_counts.GpuCounts`).

A report from a process since replaced at that address, or one seen before, is refused
(:mod:`accelsched.scheduler.authority`). When a worker
leaves, the workers refused one of its GPUs are asked to report again, so a GPU whose
owner left does not sit unused.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from accelsched import events, internals
from accelsched.protocol import (
    GUARD_PLUGIN,
    INVENTORY_HANDLER,
    OFFER_HANDLER,
    REPORT_HANDLER,
    DeviceRecord,
    InventoryReply,
    OfferReply,
    report_problem,
)
from accelsched.scheduler.authority import Authority
from accelsched.scheduler.gpu_counts import GpuCounts
from accelsched.scheduler.grants import Grants

if TYPE_CHECKING:
    from distributed import Scheduler

__all__ = ["DeviceReports"]

logger = logging.getLogger(__name__)


class DeviceReports:
    """Serves the inventory and offer handlers; asks guards to report."""

    def __init__(
        self,
        scheduler: Scheduler,
        *,
        grants: Grants,
        counts: GpuCounts,
        authority: Authority,
        emit: Callable[..., None],
        active: Callable[[], bool],
    ) -> None:
        self.scheduler = scheduler
        self._grants = grants
        self._counts = counts
        self._authority = authority
        self._emit = emit
        self._active = active

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
        internals.remove_handler(self.scheduler, INVENTORY_HANDLER, self.handle_inventory)
        internals.remove_handler(self.scheduler, OFFER_HANDLER, self.handle_offer)

    def remove_worker(self, worker: str) -> None:
        """Free the worker's GPUs; workers refused one of them are asked to report again."""
        for other in self._grants.remove(worker):
            if other in self.scheduler.workers:
                internals.spawn(self.scheduler, self._ask_report, other)

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
        if not self._authority.admits(worker, process, request, INVENTORY_HANDLER):
            return {"status": "refused"}
        if (problem := report_problem(devices, requested)) is not None:  # nothing granted
            logger.warning("accelsched: refused the GPU report of %s: %s", worker, problem)
            return {"status": "refused"}
        if isinstance(declared, (int, float)):
            self._grants.correct_declaration(worker, declared)
        wanted = devices[:requested]
        if not self._grants.unchanged(worker, wanted):
            self._grant(worker, wanted, declared, reason)
        return {"status": "OK", "uuids": self._grants.uuids(worker)}

    def _grant(
        self, worker: str, wanted: list[DeviceRecord], declared: float | None, reason: str | None
    ) -> None:
        """Grant what nobody else owns, and say so."""
        granted, refused = self._grants.claim(worker, wanted)
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

    # --- the offer handler -----------------------------------------------------------------

    def handle_offer(
        self, comm: Any, worker: str, process: str = "", request: str = "", count: Any = 0
    ) -> OfferReply:
        """A guard offers ``count`` of its granted GPUs (fewer while one is withdrawn)."""
        scheduler = self.scheduler
        if not self._active():
            return {"status": "no-plugin", "count": 0}
        ws = scheduler.workers.get(worker)
        if ws is None:
            return {"status": "unknown-worker", "count": 0}
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            return {"status": "invalid", "count": 0}
        if not self._authority.admits(worker, process, request, OFFER_HANDLER):
            return {"status": "refused", "count": 0}
        self._grants.offer(worker, count)
        self._counts.place(ws)
        return {"status": "OK", "count": self._grants.placed(worker)}
