"""Giving cached device memory back: pools after GPU tasks, garbage on a suspected leak.

Pools cache freed blocks so the next allocation is cheap; the cache looks like used
memory to NVML and to other processes. Every ``free_pools_every`` GPU tasks, when the
pools cache at least ``free_pools_min`` on a device the task held (and, with
``free_pools_above``, only when such a device is fuller than that fraction), the pools
of :mod:`accelsched.devices.gpu_memory` give back what they cache, device by device
(:class:`PoolFreer`). Freeing a near-empty pool after each of thousands of tiny tasks
would cost more than it returns.

Device memory that nothing reachable holds but a reference cycle does looks leaked to
NVML until Python's cyclic collector runs, and for old objects it runs rarely: an object
that refers to itself, or a failed task's exception, whose traceback keeps the task's
frames and the device arrays in their locals (distributed keeps the exception in a
message that the traceback's frames refer to: a cycle). :func:`reclaim` collects such
garbage, returning its arrays to their pools, then frees the pools. The worker's actor
(:class:`~accelsched.worker.leak_check.WorkerActor`) calls it on a confirmed leak's
``reclaim`` proposal; the leak check then measures again
(:class:`~accelsched.policy.leak.LeakDecisions` decides).
"""

from __future__ import annotations

import gc
import itertools
import logging
from collections.abc import Iterable
from typing import Any

from accelsched.context import using_device
from accelsched.devices.gpu_memory import DevicePool, active_pools
from accelsched.devices.nvml import NVMLMonitor

__all__ = ["PoolFreer", "reclaim"]

logger = logging.getLogger(__name__)


def caches_enough(pools: list[DevicePool], devices: tuple[int, ...], minimum: int) -> bool:
    """Whether the pools cache at least ``minimum`` bytes on one of ``devices``: freeing
    less is not worth a task's time. RMM owning the device pool (a fixed reserve that
    never shrinks) has no figure to wait for (CuPy's pinned host pool can be freed)."""
    try:
        per_device = [[pool.stats(device) for pool in pools] for device in devices]
    except Exception:  # a pool that cannot say: free, as before
        return True
    return any(
        any(s.fixed for s in stats) or sum(s.cached for s in stats) >= minimum
        for stats in per_device
    )


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
        if not (pools := active_pools()):
            return
        if self.minimum > 0 and not caches_enough(pools, devices, self.minimum):
            return
        if self.above > 0:
            try:
                fractions = [self.monitor.used(d) / self.monitor.device(d).memory for d in devices]
            except Exception:  # NVML does not answer: free anyway, never fail the task
                fractions = [1.0]
            if max(fractions, default=0) <= self.above:
                return
        for device in devices:  # CuPy frees the current device's pool: each is visited
            with using_device(device):
                for pool in pools:
                    pool.free_all()


def reclaim(devices: Iterable[Any]) -> int:
    """Collect garbage, then free every active pool on each of ``devices``; the bytes the
    pools said they released. Never creates a pool or a CUDA context: pools act only
    where their library is already in use (:func:`~accelsched.devices.gpu_memory.active_pools`).
    """
    gc.collect()
    pools = active_pools()
    released = 0
    for device in devices if pools else ():
        try:
            with using_device(device):
                released += sum(pool.free_all() for pool in pools)
        except Exception:  # a pool or device that does not answer: measure anyway
            logger.warning("accelsched: freeing pools on device %s failed", device, exc_info=True)
    return released
