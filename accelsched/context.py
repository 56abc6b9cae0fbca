"""What a running task knows about the device it holds.

CUDA's current device is per thread, and a worker runs several tasks at once in its
thread pool, so the device a task holds is kept in a thread-local set by the guard just
before the task's function runs (see :mod:`accelsched.policy.leases`) and cleared after it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from accelsched.devices import gpu_memory
from accelsched.devices.gpu_memory import MemoryCap, cuda

__all__ = [
    "Lease",
    "current_device",
    "current_lease",
    "array_module",
    "holding",
    "bind",
    "unbind",
    "released",
    "using_device",
]


@dataclass(frozen=True)
class Lease:
    """The devices one task holds while it runs.

    ``devices`` are CUDA indices as this process sees them (positions within
    ``CUDA_VISIBLE_DEVICES``).
    """

    key: object
    devices: tuple[int, ...]
    #: ``report(action, **figures)``: sends an accelsched event from the task's worker.
    report: Callable[..., None] | None = None
    #: Dotted names of exceptions meaning "out of device memory" (``oom_exceptions``).
    oom_exceptions: tuple[str, ...] = ()
    #: ``meter(step_name, call)``: runs ``call()`` measuring what that marked step leaves
    #: on the device (the guard's attribution); None where nothing measures.
    meter: Callable[[str, Callable[[], Any]], Any] | None = None
    #: What the task's allocations hold against the memory it declared (None: it
    #: declared none); see :mod:`accelsched.devices.gpu_memory`.
    cap: MemoryCap | None = None


_local = threading.local()


def current_lease() -> Lease | None:
    return getattr(_local, "lease", None)


def current_device() -> int | None:
    """The device index the running task holds; None outside a task holding a GPU."""
    lease = current_lease()
    return None if lease is None else lease.devices[0]


gpu_memory.task_device = current_device  # objects on an unknown device count on the task's


def array_module() -> ModuleType:
    """``cupy`` inside a task holding a real GPU, ``numpy`` everywhere else.

    Write a step once against the returned module (``xp = array_module(); xp.sum(...)``)
    and it runs on the device when placed on a GPU and on the host when it fell back.
    The NVML backend's CUDA says which (:mod:`accelsched.devices.gpu_memory`): on the
    simulated GPUs of :mod:`accelsched.testing` it is numpy, they run no kernels.
    """
    if current_lease() is not None:
        return cuda().array_module()
    import numpy

    return numpy


@contextmanager
def holding(lease: Lease) -> Iterator[Lease]:
    """Make ``lease`` current in this thread and, on real GPUs, its device CUDA's current one."""
    bound = bind(lease)
    try:
        yield lease
    finally:
        unbind(bound)


def bind(lease: Lease) -> tuple[Lease | None, list[Callable[[], Any]]]:
    """:func:`holding` without a generator (the guard's per-task path): make ``lease``
    current; returns what :func:`unbind` needs to restore the thread's state."""
    previous = getattr(_local, "lease", None)
    _local.lease = lease
    undo: list[Callable[[], Any]] = []
    try:
        backend = cuda()
        if (restore := backend.use(lease.devices[0])) is not None:
            undo.append(restore)
        if lease.cap is not None and (uncount := backend.count(lease.cap)) is not None:
            undo.append(uncount)
        return previous, undo
    except BaseException:
        unbind((previous, undo))
        raise


def unbind(bound: tuple[Lease | None, list[Callable[[], Any]]]) -> None:
    previous, undo = bound
    _local.lease = previous
    for step in reversed(undo):
        step()


@contextmanager
def released() -> Iterator[None]:
    """Run host code inside a GPU task as if it held no GPU (``dual``'s OOM retry)."""
    previous = current_lease()
    _local.lease = None
    try:
        yield
    finally:
        _local.lease = previous


@contextmanager
def using_device(device: int) -> Iterator[None]:
    """Make ``device`` CUDA's current one in this thread for a moment (as the backend's
    CUDA does: nothing on simulated GPUs)."""
    restore = cuda().use(device)
    try:
        yield
    finally:
        if restore is not None:
            restore()


#: Exception types registered as "out of device memory", beside ``oom_exceptions``.
_OOM_TYPES: set[type[BaseException]] = set()


def register_oom_exception(exc_type: type[BaseException]) -> None:
    """Count ``exc_type`` (and its subclasses) as running out of device memory in every
    ``dual`` task of this process, whatever ``oom_exceptions`` says."""
    if not (isinstance(exc_type, type) and issubclass(exc_type, BaseException)):
        raise TypeError(f"register_oom_exception() takes an exception type, not {exc_type!r}")
    _OOM_TYPES.add(exc_type)


def out_of_memory(exc: BaseException, names: tuple[str, ...]) -> bool:
    """Whether ``exc`` means "out of device memory": a type named in ``names`` (the
    guard's ``oom_exceptions``; by name, so CuPy is never imported to check) or registered."""
    return any(
        c in _OOM_TYPES or f"{c.__module__}.{c.__qualname__}" in names for c in type(exc).__mro__
    )
