"""Freeing the memory pools of CUDA libraries after GPU tasks.

Pools cache freed blocks so the next allocation is cheap; the cache looks like used
memory to NVML and to other processes. Every ``free_pools_every`` GPU tasks, when the
pools cache at least ``free_pools_min`` on a device the task held (and, with
``free_pools_above``, only when such a device is fuller than that fraction), the pools
of :mod:`accelsched.devices.pool` give back what they cache, device by device. Freeing a
near-empty pool after each of thousands of tiny tasks would cost more than it returns.
"""

from __future__ import annotations

import itertools

from accelsched.context import using_device
from accelsched.devices.nvml import NVMLMonitor
from accelsched.devices.pool import active_pools

__all__ = ["PoolFreer"]


class PoolFreer:
    """Called in a GPU task's thread as it ends, with the devices it held."""

    def __init__(
        self,
        *,
        every: int,
        above: float,
        monitor: NVMLMonitor,
        minimum: int = 0,
    ) -> None:
        self.every = every
        self.above = above
        self.minimum = minimum
        self.monitor = monitor
        self._count = itertools.count(1)  # next() is atomic across threads

    def after_gpu_task(self, devices: tuple[int, ...]) -> None:
        if not self.every or next(self._count) % self.every:
            return
        pools = active_pools()
        if not pools:
            return
        if self.minimum > 0 and not self._caches_enough(pools, devices):
            return
        if self.above > 0:
            try:
                fractions = [self.monitor.used(d) / self.monitor.device(d).memory for d in devices]
            except Exception:  # NVML does not answer: free anyway, never fail the task
                fractions = [1.0]
            if max(fractions, default=0) <= self.above:
                return
        # CuPy frees the current device's pool: visit each device the task held
        for device in devices:
            with using_device(device):
                for pool in pools:
                    pool.free_all()

    def _caches_enough(self, pools: list, devices: tuple[int, ...]) -> bool:
        """Whether the pools cache at least ``minimum`` bytes on one of ``devices``."""
        for device in devices:
            cached = 0
            for pool in pools:
                try:
                    stats = pool.stats(device)
                except Exception:  # a pool that cannot say: free, as before
                    return True
                if stats.fixed:  # RMM owns the device pool (never shrinks): what can be
                    return True  # freed (CuPy's pinned host pool) has no figure to wait for
                cached += stats.cached
            if cached >= self.minimum:
                return True
        return False
