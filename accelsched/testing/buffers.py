"""Simulated device buffers: what ``device_alloc`` hands a task on a fake GPU.

A :class:`DeviceBuffer` holds ``nbytes`` of the simulated pool of
:mod:`accelsched.testing.device_memory` on one device until it is freed (garbage-collected), or
for the life of the process with ``leak=True``. The guard sees it as a live result
(``device_nbytes``) and dask's ``sizeof`` counts its payload.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from typing import Any

from dask.sizeof import sizeof

from accelsched import devices
from accelsched.context import current_device, current_lease
from accelsched.devices import device_nbytes
from accelsched.testing import state
from accelsched.testing.device_memory import OutOfDeviceMemory, _pool

__all__ = ["DeviceBuffer", "OutOfDeviceMemory", "create_context", "device_alloc", "fixed_pool"]

_LEAKED: list[DeviceBuffer] = []


def _after_fork() -> None:
    """A forked child owns none of its parent's leaked buffers."""
    _LEAKED.clear()


os.register_at_fork(after_in_child=_after_fork)


class DeviceBuffer:
    """Simulated device memory: ``nbytes`` on ``device`` until freed, carrying ``value``.

    Create with :func:`device_alloc`. ``device`` is None once freed, or when the buffer
    was unpickled where its device is not visible (detached). Pickling sends the value
    and size; unpickling where fake GPUs are visible allocates again on the same CUDA
    index, as deserializing a CuPy array does.
    """

    __slots__ = ("nbytes", "value", "_device", "_finalizer", "__weakref__")

    def __init__(
        self,
        nbytes: int,
        device: int | None,
        value: Any = None,
        finalizer: weakref.finalize | None = None,
    ) -> None:
        self.nbytes = nbytes
        self.value = value
        self._device = device
        self._finalizer = finalizer

    @property
    def device(self) -> int | None:
        if self._finalizer is None or not self._finalizer.alive:
            return None
        return self._device

    def free(self) -> None:
        """Return the bytes to the pool's cache now (idempotent)."""
        if self._finalizer is not None:
            self._finalizer()
        with contextlib.suppress(ValueError):
            _LEAKED.remove(self)

    def __reduce__(self) -> tuple[Any, tuple[int, int | None, Any]]:
        return _rebuild, (self.nbytes, self.device, self.value)

    def __repr__(self) -> str:
        where = "detached" if self.device is None else f"on fake GPU {self.device}"
        return f"<DeviceBuffer {self.nbytes} bytes {where}>"


def _rebuild(nbytes: int, device: int | None, value: Any) -> DeviceBuffer:
    path = state.state_dir()
    if device is None or path is None:
        return DeviceBuffer(nbytes, None, value)
    if device >= _pool().visible():
        return DeviceBuffer(nbytes, None, value)
    return device_alloc(nbytes, device=device, value=value)


@sizeof.register(DeviceBuffer)
def _sizeof_buffer(buf: DeviceBuffer) -> int:
    return buf.nbytes


@device_nbytes.register(DeviceBuffer)
def _device_nbytes_buffer(buf: DeviceBuffer) -> dict[int, int]:
    device = buf.device
    return {} if device is None else {device: buf.nbytes}


if hasattr(devices, "to_host"):

    @devices.to_host.register(DeviceBuffer)
    def _buffer_to_host(buf: DeviceBuffer) -> DeviceBuffer:
        """A fallen-back task gets the payload on the host: a detached buffer, same size."""
        return DeviceBuffer(buf.nbytes, None, buf.value)


def _device_or_current(device: int | None, what: str) -> int:
    if device is None:
        device = current_device()
    if device is None:
        raise RuntimeError(
            f"{what}: no device given and no current device; call it inside a task holding "
            "a GPU, or pass device=..."
        )
    return device


def _check_nbytes(nbytes: int, what: str) -> None:
    if isinstance(nbytes, bool) or not isinstance(nbytes, int):
        raise TypeError(f"{what}: nbytes must be an int, got {nbytes!r}")
    if nbytes < 0:
        raise ValueError(f"{what}: nbytes must be >= 0, got {nbytes!r}")


def device_alloc(
    nbytes: int, leak: bool = False, device: int | None = None, value: Any = None
) -> DeviceBuffer:
    """Allocate ``nbytes`` of simulated device memory on a fake GPU.

    ``device`` defaults to the device of the running task (``current_device()``).
    The bytes come from a fixed pool with room, else the pool's cache, else new device
    memory (raising :class:`OutOfDeviceMemory` when the device is full even after freeing
    the cache). With ``leak=True`` the buffer is kept alive until the process exits.
    """
    _check_nbytes(nbytes, "device_alloc")
    device = _device_or_current(device, "device_alloc")
    pool = _pool()
    lease = current_lease()
    cap = None if lease is None else lease.cap  # counted as CuPy's allocator would be
    if cap is not None:
        cap.take(nbytes)  # under enforce, refused before anything is taken
    try:
        session, fixed = pool.allocate(nbytes, device)
    except BaseException:
        if cap is not None:
            cap.give(nbytes)
        raise
    buf = DeviceBuffer(nbytes, device, value)
    buf._finalizer = weakref.finalize(buf, _release, pool, session, device, nbytes, fixed, cap)
    buf._finalizer.atexit = False  # the process's death frees its device memory
    if leak:
        _LEAKED.append(buf)
    return buf


def _release(pool: Any, session: Any, device: int, nbytes: int, fixed: Any, cap: Any) -> None:
    pool.release(session, device, nbytes, fixed)
    if cap is not None:
        cap.give(nbytes)


def create_context(device: int | None = None) -> None:
    """Simulate a library creating a CUDA context on ``device`` without allocating.

    The context's bytes show in NVML for this process and belong to no pool: only the
    process's death releases them, as with real CUDA.
    """
    _pool().create_context(_device_or_current(device, "create_context"))


def fixed_pool(nbytes: int, device: int | None = None) -> None:
    """Reserve an RMM-style pool of ``nbytes`` on ``device``, visible in NVML at once.

    Allocations come out of it while it has room; ``free_all()`` never shrinks it and
    the guard's ``stats().fixed`` reports it. ``device`` defaults to the current task's
    device, else CUDA device 0, as ``--rmm-pool-size`` reserves on a worker's first
    visible device. Calling again with the same size is a no-op.
    """
    _check_nbytes(nbytes, "fixed_pool")
    if nbytes == 0:  # (it never grows: a pool of nothing, which a second call would not see)
        raise ValueError("fixed_pool: nbytes must be more than 0, got 0")
    if device is None:
        device = current_device()
    _pool().reserve(nbytes, 0 if device is None else device)
