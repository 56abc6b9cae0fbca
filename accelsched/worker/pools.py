"""Freeing the memory pools of CUDA libraries after GPU tasks.

Pools cache freed blocks so the next allocation is cheap; the cache looks like used
memory to NVML and to other processes. Every ``free_pools_every`` GPU tasks (and, with
``free_pools_above``, only when a device the task held is fuller than that fraction) the
pools of :mod:`accelsched.devices.pool` give back what they cache, device by device.
"""

from __future__ import annotations

import itertools

from accelsched.context import using_device
from accelsched.devices.nvml import NVMLMonitor
from accelsched.devices.pool import active_pools

__all__ = ["PoolFreer"]


class PoolFreer:
    """Called in a GPU task's thread as it ends, with the devices it held."""

    def __init__(self, *, every: int, above: float, monitor: NVMLMonitor, simulated: bool) -> None:
        self.every = every
        self.above = above
        self.monitor = monitor
        self.simulated = simulated
        self._count = itertools.count(1)  # next() is atomic across threads

    def after_gpu_task(self, devices: tuple[int, ...]) -> None:
        if not self.every or next(self._count) % self.every:
            return
        if self.above > 0:
            try:
                fractions = [self.monitor.used(d) / self.monitor.device(d).memory for d in devices]
            except Exception:  # NVML does not answer: free anyway, never fail the task
                fractions = [1.0]
            if max(fractions, default=0) <= self.above:
                return
        pools = active_pools()
        # CuPy frees the current device's pool: visit each device the task held
        for device in devices:
            with using_device(device, simulated=self.simulated):
                for pool in pools:
                    pool.free_all()
