"""Devices this process left out of its inventory, asked again until they answer.

A device that does not answer NVML when the guard takes its inventory is left out
(:meth:`~accelsched.devices.nvml.NVMLMonitor.devices`), often in the very process a
restart for that device's failure started. It is not given up on: with ``recover_gpus``,
every check asks :class:`~accelsched.policy.health.Probation` which left-out devices are due,
asks NVML about them, and a device that answers steadily enters the inventory, which
reports it to the scheduler like any device (``accelsched_inventory``: confirmed,
verified, one owner per UUID). Once the scheduler grants it, the worker offers it and
says so (``gpu-recovered``). A report that does not get it granted (the scheduler busy
with the restarts of the same fault, a peer's claim not yet gone) is not the last word:
it is made again, with the same backoff, until the device is granted.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from time import monotonic

from accelsched import events
from accelsched.devices.nvml import DeviceInfo
from accelsched.policy.health import Probation
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
        interval: float,
        report: Callable[[], Awaitable[ReportReply]],
        spawn: Callable[..., None],
        emit: Callable[..., None],
        clock: Callable[[], float] = monotonic,
    ) -> None:
        self.inventory = inventory
        # asked at the check's pace while it answers; at most every 30 s while it does not
        self.probation = Probation(inventory.health, first=interval, longest=max(interval, 30.0))
        self._report = report
        self._spawn = spawn  # runs a coroutine function in the background
        self._emit = emit
        self._clock = clock
        #: Back in the inventory, not granted yet: reported again when due.
        self._ungranted: dict[int, DeviceInfo] = {}
        self._report_at = 0.0
        self._report_wait = interval
        self._reporting = False
        now = clock()
        for index in inventory.monitor.left_out:
            self.probation.left_out(index, now)

    @property
    def waiting(self) -> list[int]:
        """Devices still out of this process, or back but not granted yet."""
        return sorted({*self.probation.waiting, *self._ungranted})

    def check(self) -> None:
        """Probe the devices due now (event loop, at each check)."""
        now = self._clock()
        back: list[DeviceInfo] = []
        for index in self.probation.due(now):
            try:
                info = self.inventory.monitor.query(index)
            except Exception:  # NVMLError: still out
                self.probation.failed(index, now)
                continue
            if self.probation.answered(index, now):
                back.append(info)
        for info in back:
            self.inventory.rejoin(info)
            self._ungranted[info.index] = info
        if back:
            self._report_at, self._report_wait = now, self.probation.first
        if self._ungranted and not self._reporting and now >= self._report_at:
            self._reporting = True
            self._spawn(self._offer)

    async def _offer(self) -> None:
        """Report the inventory with the devices back; say which the scheduler granted,
        and when to report the others again."""
        try:
            reply = await self._report()
        finally:
            self._reporting = False
        granted = {d.uuid for d in self.inventory.granted}
        for index, info in list(self._ungranted.items()):
            if info.uuid in granted:
                del self._ungranted[index]
                self._emit(events.GPU_RECOVERED, device=info.index, uuid=info.uuid)
            elif self._report_wait == self.probation.first:  # said once per device back
                logger.info(
                    "accelsched: GPU %d answers NVML again but is not granted yet (%s); "
                    "reporting it again",
                    info.index,
                    reply.get("status"),
                )
        self._report_at = self._clock() + self._report_wait
        self._report_wait = min(self.probation.longest, 2 * self._report_wait)
