"""Devices this process left out of its inventory, asked again until they answer.

A device that does not answer NVML when the guard takes its inventory is left out
(:meth:`~accelsched.devices.nvml.NVMLMonitor.devices`), often in the very process a
restart for that device's failure started. It is not given up on: with ``recover_gpus``,
every check asks :class:`~accelsched.policy.health.Probation` which left-out devices are due,
asks NVML about them, and a device that answers steadily enters the inventory, which
reports it to the scheduler like any device (``accelsched_inventory``: confirmed,
verified, one owner per UUID). Once the scheduler grants it, the worker offers it and
says so (``gpu-recovered``).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from time import monotonic

from accelsched import events
from accelsched.devices.nvml import DeviceInfo
from accelsched.policy.health import DeviceHealth, Probation
from accelsched.protocol import ReportReply
from accelsched.worker.inventory import Inventory

__all__ = ["Rejoin"]

logger = logging.getLogger(__name__)


class Rejoin:
    """Probes the left-out devices when :class:`Probation` says; reports those back."""

    def __init__(
        self,
        *,
        inventory: Inventory,
        health: DeviceHealth,
        interval: float,
        report: Callable[[], Awaitable[ReportReply]],
        spawn: Callable[..., None],
        emit: Callable[..., None],
        clock: Callable[[], float] = monotonic,
    ) -> None:
        assert inventory.monitor is not None
        self.inventory = inventory
        self.monitor = inventory.monitor
        # asked at the check's pace while it answers; at most every 30 s while it does not
        self.probation = Probation(health, first=interval, longest=max(interval, 30.0))
        self._report = report
        self._spawn = spawn  # runs a coroutine function in the background
        self._emit = emit
        self._clock = clock
        now = clock()
        for index in self.monitor.left_out:
            self.probation.left_out(index, now)

    @property
    def waiting(self) -> list[int]:
        return self.probation.waiting

    def check(self) -> None:
        """Probe the devices due now (event loop, at each check)."""
        now = self._clock()
        back: list[DeviceInfo] = []
        for index in self.probation.due(now):
            try:
                info = self.monitor.query(index)
            except Exception:  # NVMLError: still out
                self.probation.failed(index, now)
                continue
            if self.probation.answered(index, now):
                back.append(info)
        if back:
            for info in back:
                self.inventory.rejoin(info)
            self._spawn(self._offer, back)

    async def _offer(self, back: list[DeviceInfo]) -> None:
        """Report the inventory with the devices back; say which the scheduler granted."""
        reply = await self._report()
        granted = {d.uuid for d in self.inventory.granted}
        for info in back:
            if info.uuid in granted:
                self._emit(events.GPU_RECOVERED, device=info.index, uuid=info.uuid)
            else:  # claimed by another worker meanwhile, or more than this one declared
                logger.info(
                    "accelsched: GPU %d answers NVML again but is not granted (%s)",
                    info.index,
                    reply.get("status"),
                )
