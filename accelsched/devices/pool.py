"""The *pool* seam: allocators that cache device memory inside a worker process.

CUDA libraries keep freed device memory in pools so the next allocation is cheap. NVML
cannot tell cached memory from memory in use, so the guard asks the pools two things:
how much of what NVML sees they legitimately hold, and to give back what they can.

Two kinds of pool exist here: CuPy's default device pool plus its pinned host pool
(:class:`CupyPool`, RMM-aware), and the simulated pool of :mod:`accelsched.testing`.
Pools register themselves in :data:`POOLS`; nothing in this module imports CuPy unless
CuPy is already imported by the process (freeing a pool must never create one).
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

__all__ = ["PoolStats", "DevicePool", "CupyPool", "POOLS", "register_pool", "active_pools"]


@dataclass(frozen=True)
class PoolStats:
    """What one pool holds on one device, in bytes.

    ``held`` is everything the pool has taken from the driver (in use + cached + a fixed
    reservation). ``cached`` is the part that :meth:`DevicePool.free_all` could return.
    ``fixed`` is a reservation that cannot shrink (an RMM pool): retained, never a leak.
    ``fixed_free`` is the unused part of that reservation, None when the pool cannot say
    (RMM without a statistics adaptor).
    """

    held: int = 0
    cached: int = 0
    fixed: int = 0
    fixed_free: int | None = 0

    def __add__(self, other: PoolStats) -> PoolStats:
        free = (
            None
            if self.fixed_free is None or other.fixed_free is None
            else self.fixed_free + other.fixed_free
        )
        return PoolStats(
            self.held + other.held, self.cached + other.cached, self.fixed + other.fixed, free
        )


@runtime_checkable
class DevicePool(Protocol):
    """An allocator that caches device memory in this process."""

    name: str

    def active(self) -> bool:
        """True when the pool exists in this process (never creates it)."""

    def free_all(self) -> int:
        """Release cached blocks to the driver; return the bytes released."""

    def stats(self, device: int) -> PoolStats:
        """What the pool holds on ``device`` (a CUDA index of this process)."""


class CupyPool:
    """CuPy's default device pool and pinned pool, left alone when RMM owns allocation.

    Active only when ``cupy`` is already in ``sys.modules`` (:func:`active_pools` asks
    nothing else of an inactive pool): the guard must never import CuPy (and create a
    CUDA context) just to free a pool nobody used.
    """

    name = "cupy"

    def active(self) -> bool:
        return "cupy" in sys.modules

    def uses_rmm(self) -> bool:
        """True when CuPy (imported) allocates through RMM (``rmm_cupy_allocator``)."""
        allocator = sys.modules["cupy"].cuda.get_allocator()
        owner = getattr(allocator, "__module__", "") or ""
        qual = getattr(allocator, "__qualname__", "") or repr(allocator)
        return owner.startswith("rmm") or "rmm" in qual

    def free_all(self) -> int:
        cp = sys.modules["cupy"]
        released = 0
        try:
            if not self.uses_rmm():
                pool = cp.get_default_memory_pool()
                before = pool.total_bytes()
                pool.free_all_blocks()
                released = before - pool.total_bytes()
            cp.get_default_pinned_memory_pool().free_all_blocks()
        except RuntimeError:
            # cupy imported on a machine without a usable device: nothing to free
            return 0
        return max(0, released)

    def stats(self, device: int) -> PoolStats:
        cp = sys.modules["cupy"]
        try:
            if self.uses_rmm():  # reserved up front, it cannot shrink: all of it is fixed
                try:
                    mr = sys.modules["rmm.mr"]
                    size = getattr(mr.get_per_device_resource(device), "pool_size", None)
                    reserved = int(size() if callable(size) else (size or 0))
                except Exception:  # no rmm.mr imported, or a resource that cannot say
                    reserved = 0
                return PoolStats(held=reserved, cached=0, fixed=reserved, fixed_free=None)
            with cp.cuda.Device(device):
                pool = cp.get_default_memory_pool()
                return PoolStats(held=int(pool.total_bytes()), cached=int(pool.free_bytes()))
        except RuntimeError:
            return PoolStats()


POOLS: list[DevicePool] = [CupyPool()]
_lock = threading.Lock()


def register_pool(pool: DevicePool) -> None:
    """Add a pool the guard should free and account for (idempotent by identity)."""
    with _lock:
        if not any(p is pool for p in POOLS):
            POOLS.append(pool)


def active_pools() -> list[DevicePool]:
    return [p for p in POOLS if p.active()]
