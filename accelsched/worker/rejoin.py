"""Devices this process left out of its inventory, asked again until they answer.

A device that does not answer NVML when the guard takes its inventory is left out
(:meth:`~accelsched.devices.nvml.NVMLMonitor.devices`), often in the very process a
restart for that device's failure started. It is not given up on: with ``recover_gpus``,
every check asks :class:`~accelsched.policy.leak.DeviceHealth` which left-out devices are due,
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
from accelsched.protocol import ReportReply
from accelsched.worker.inventory import Inventory

__all__ = ["Rejoin"]

logger = logging.getLogger(__name__)


class Rejoin:
    """Probes the left-out devices when the inventory's
    :class:`~accelsched.policy.leak.DeviceHealth` says; reports those back."""

    def __init__(
        self,
        *,
        inventory: Inventory,
        report: Callable[[], Awaitable[ReportReply]],
        spawn: Callable[..., None],
        emit: Callable[..., None],
        clock: Callable[[], float] = monotonic,
    ) -> None:
        self.inventory = inventory
        self.health = inventory.health  # when each left-out device is tried again
        self._report = report
        self._spawn = spawn  # runs a coroutine function in the background
        self._emit = emit
        self._clock = clock
        self._reporting = False
        now = clock()
        for index in inventory.monitor.left_out:
            self.health.left_out(index, now)

    @property
    def waiting(self) -> list[int]:
        """Devices still out of this process, or back but not granted yet."""
        return self.health.waiting

    def check(self) -> None:
        """Probe the devices due now, and report those back when due (event loop, at each
        check)."""
        now, monitor = self._clock(), self.inventory.monitor
        out, report = monitor.left_out, False
        for index in self.health.due(now):
            if index not in out:  # back, not granted yet: due to be reported again
                report = True
                continue
            try:
                info = monitor.query(index)
            except Exception:  # NVMLError: still out
                self.health.retry(index, now)
                continue
            if self.health.probe_answered(index, now):
                self.inventory.rejoin(info)
                report = True
        if report and not self._reporting:
            self._reporting = True
            self._spawn(self._offer)

    async def _offer(self) -> None:
        """Report the inventory with the devices back; say which the scheduler granted,
        and when to report the others again."""
        try:
            reply = await self._report()
        finally:
            self._reporting = False
        granted, monitor = {d.uuid for d in self.inventory.granted}, self.inventory.monitor
        now, out = self._clock(), monitor.left_out
        for index in self.health.waiting:
            if index in out:
                continue
            info = monitor.device(index)
            if info.uuid in granted:
                self.health.granted(index)
                self._emit(events.GPU_RECOVERED, device=index, uuid=info.uuid)
            elif self.health.retry(index, now) == self.health.first:  # once per device back
                logger.info(
                    "accelsched: GPU %d answers NVML again but is not granted yet (%s); "
                    "reporting it again",
                    index,
                    reply.get("status"),
                )
