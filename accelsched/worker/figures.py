"""What only the worker knows, for ``accelsched status`` and the dashboard page.

Leases in use and the leak estimate live in this worker's guard. Rather than a new RPC
loop, they ride on distributed's own heartbeat: the guard registers :meth:`Figures.read`
as a custom worker metric (:data:`~accelsched.protocol.GUARD_METRIC`), and the scheduler
finds the latest figures in the worker's ``WorkerState``. Reading is O(devices + running
GPU tasks) on the event loop, once per heartbeat.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from accelsched.devices.nvml import DeviceInfo
from accelsched.policy.leases import LeaseTable
from accelsched.protocol import DeviceFigures, GuardMetric
from accelsched.worker.leak_check import LeakCheck

__all__ = ["Figures"]


class Figures:
    """Reads the guard's parts; remembers each device's last judged leak estimate.

    The leak check skips a device while a GPU task runs on it (its temporaries are no
    leak), so its latest verdicts may lack one: the estimate shown is the last one made.
    """

    def __init__(
        self,
        *,
        granted: Callable[[], list[DeviceInfo]],
        withdrawn: Callable[[], set[int]],
        leases: LeaseTable,
        leaks: LeakCheck,
    ) -> None:
        self._granted = granted
        self._withdrawn = withdrawn
        self.leases = leases
        self.leaks = leaks
        self.estimates: dict[int, int] = {}  # device -> last judged leak estimate

    def read(self, worker: Any = None) -> GuardMetric:
        """The heartbeat metric (distributed calls it with the worker)."""
        for v in self.leaks.last_verdicts:
            self.estimates[v.device] = v.estimate
        held: dict[int, int] = {}
        for devices in self.leases.holders().values():
            for d in devices:
                held[d] = held.get(d, 0) + 1
        withdrawn = self._withdrawn()
        declared = self.leases.declared()
        out: list[DeviceFigures] = [
            {
                "index": dev.index,
                "leases": held.get(dev.index, 0),
                "withdrawn": dev.index in withdrawn,
                "leak_estimate": self.estimates.get(dev.index),
                "leak_threshold": self.leaks.threshold.resolve(dev.memory),
                "declared": declared.get(dev.index, 0),
            }
            for dev in self._granted()
        ]
        return {"devices": out}
