"""What one task holds of the device memory it declared, counted at each allocation.

Packing (:func:`accelsched.policy.requirements.pack`) puts tasks on a device while
their *declared* needs fit; a task that takes more than it declared takes it from its
neighbours, which then run out of memory through no fault of theirs. The guard gives
each task that declared memory a :class:`MemoryCap`, and the task's allocations count
against it: on real GPUs through a CuPy allocator set for the task's thread alone
(``cupy.cuda.using_allocator`` is thread-local, and each task runs in its own thread of
the worker's pool), on the simulated GPUs of :mod:`accelsched.testing` in
``device_alloc``. With ``enforce`` (``enforce_memory=True``, or
``gpu(memory=..., enforce=True)``) the allocation that would pass the declaration fails
with :class:`DeclaredMemoryExceeded` before it takes anything, so the neighbours are
untouched; without, the peak is measured and reported (``over-declared``).

Only allocations made through CuPy's allocator are seen: memory a library takes
directly from CUDA or from an RMM pool of its own (cuDF does, under
``rmm_cupy_allocator`` too, for everything but CuPy arrays) is neither capped nor counted
(docs/placement.md).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from dask.utils import format_bytes

__all__ = ["DeclaredMemoryExceeded", "MemoryCap", "counted_allocator"]


class DeclaredMemoryExceeded(MemoryError):
    """A task tried to hold more device memory than it declared, under ``enforce``.

    A ``MemoryError`` (an allocation refused), but not one of the ``oom_exceptions``:
    a ``dual`` task does not retry on the CPU, since the declaration, not the device,
    is wrong.
    """

    def __init__(self, key: str, declared: int, held: int, attempted: int) -> None:
        self.key, self.declared, self.held, self.attempted = key, declared, held, attempted
        super().__init__(
            f"task {key!r} declared {format_bytes(declared)} of device memory "
            f"({declared} bytes) and tried to allocate {format_bytes(attempted)} "
            f"({attempted} bytes) while holding {format_bytes(held)}: declare what it "
            "needs (gpu(memory=...))"
        )

    def __reduce__(self) -> tuple[type, tuple[str, int, int, int]]:
        # the error travels to the client: rebuilt from its figures, not its message
        return type(self), (self.key, self.declared, self.held, self.attempted)


class MemoryCap:
    """The device memory one task's allocations hold now and at most, against what it
    declared; ``enforce``: an allocation past the declaration is refused.

    Allocations end on whichever thread drops the last reference (a result freed
    later, the garbage collector), so the figures are kept under a lock.
    """

    def __init__(self, key: str, declared: int, *, enforce: bool) -> None:
        if declared <= 0:
            raise ValueError(f"a memory cap needs declared bytes > 0, got {declared!r}")
        self.key = key
        self.declared = declared
        self.enforce = enforce
        self.held = 0
        self.peak = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> None:
        """Count an allocation of ``nbytes`` about to be made; under ``enforce``, raise
        :class:`DeclaredMemoryExceeded` instead when it would pass the declaration."""
        with self._lock:
            held = self.held + nbytes
            if self.enforce and held > self.declared:
                raise DeclaredMemoryExceeded(self.key, self.declared, self.held, nbytes)
            self.held = held
            self.peak = max(self.peak, held)

    def give(self, nbytes: int) -> None:
        """An allocation counted by :meth:`take` ended (or was never made)."""
        with self._lock:
            self.held -= nbytes

    @property
    def over(self) -> bool:
        """Whether the task held more at some moment than it declared."""
        return self.peak > self.declared


def counted_allocator(cap: MemoryCap, inner: Callable[[int], Any]) -> Callable[[int], Any]:
    """A CuPy allocator that takes its blocks from ``inner`` (the allocator in effect:
    CuPy's pool, or RMM's) and counts them against ``cap`` while they live.

    A block is handed out wrapped (``UnownedMemory`` keeps an owner alive for as long as
    any array uses the memory), and the owner gives the bytes back to ``cap`` as it goes
    and the block back to ``inner``'s pool: CuPy's ``MemoryPointer`` itself takes no
    finalizer.
    """
    from cupy.cuda.memory import MemoryPointer, UnownedMemory

    def malloc(size: int) -> Any:
        cap.take(size)
        try:
            block = inner(size)
        except BaseException:
            cap.give(size)
            raise
        owner = _Counted(block, cap, size)
        return MemoryPointer(UnownedMemory(block.ptr, size, owner, block.device_id), 0)

    return malloc


class _Counted:
    """A block of ``inner``'s, held for as long as arrays use it; gives its bytes back."""

    __slots__ = ("block", "cap", "size")

    def __init__(self, block: Any, cap: MemoryCap, size: int) -> None:
        self.block, self.cap, self.size = block, cap, size

    def __del__(self) -> None:
        self.cap.give(self.size)
