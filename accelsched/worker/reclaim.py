"""Reclaim before restart: give back what only garbage holds, on a suspected leak's devices.

Device memory that nothing reachable holds but a reference cycle does looks leaked to
NVML until Python's cyclic collector runs, and for old objects it runs rarely: an object
that refers to itself, or a failed task's exception, whose traceback keeps the task's
frames and the device arrays in their locals (distributed keeps the exception in a
message that the traceback's frames refer to: a cycle). ``gc.collect()`` returns such
arrays to their pools, and freeing the pools returns the pools' caches to the driver.
The worker's actor (:class:`~accelsched.worker.worker_actor.WorkerActor`) calls this on a
confirmed leak's ``reclaim`` proposal; the leak check then measures again
(:class:`~accelsched.policy.leak.Reclaims` decides).
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterable

from accelsched.context import using_device
from accelsched.devices.pool import active_pools

__all__ = ["reclaim", "freeze_startup_objects"]

logger = logging.getLogger(__name__)


def freeze_startup_objects() -> None:
    """Move every object alive now (modules, distributed's worker, the guard) out of the
    collector's reach (``gc.freeze()``), once, when the guard is set up: a reclaim's full
    collection then scans only what was made since, and takes a fraction of the time it
    took (it holds the event loop and the GIL). Frozen objects are still freed by
    reference counting; only a reference cycle that is garbage already now stays (no
    collection first: it would hold up the worker's start by as long)."""
    if not gc.get_freeze_count():
        gc.freeze()


def reclaim(devices: Iterable[int]) -> int:
    """Collect garbage, then free every active pool on each of ``devices``; the bytes the
    pools said they released. Never creates a pool or a CUDA context: pools act only
    where their library is already in use (:func:`~accelsched.devices.pool.active_pools`).
    """
    gc.collect()
    pools = active_pools()
    released = 0
    if not pools:
        return released
    for device in devices:  # CuPy frees the current device's pool: visit each one
        try:
            with using_device(device):
                for pool in pools:
                    released += pool.free_all()
        except Exception:  # a pool or device that does not answer: measure anyway
            logger.warning("accelsched: freeing pools on device %s failed", device, exc_info=True)
    return released
