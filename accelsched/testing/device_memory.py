"""The simulated pool: device memory with CuPy's and RMM's pool semantics, seen by NVML.

Leak detection has to tell memory a task leaked from memory a pool legitimately caches
or reserves, and that is only testable if the test can produce all three on purpose.
``device_alloc`` (:mod:`accelsched.testing.buffers`) does, on the fake GPUs of
:func:`accelsched.testing.fake_gpus`: every change is published to the state directory
(``proc/<pid>``), so the fake NVML, and hence the guard's monitor, sees this process's
memory exactly as nvidia-smi would see CuPy's:

* a first allocation on a device creates a CUDA context (``context_bytes``) that no pool
  owns and nothing but the process's death releases;
* freed buffers go back to the pool's cache: NVML still counts them until ``free_all()``;
* an RMM-style :func:`fixed_pool` is reserved up front and never shrinks;
* ``leak=True`` buffers stay referenced until the process exits.

Devices are CUDA indices of this process (what ``current_device()`` returns), mapped to
NVML indices through ``CUDA_VISIBLE_DEVICES`` as CUDA would, once per session.
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

from accelsched.context import register_oom_exception
from accelsched.devices import PoolStats, register_pool, visible_from_env
from accelsched.testing import state

__all__ = ["OutOfDeviceMemory", "SimulatedPool"]


class OutOfDeviceMemory(MemoryError):
    """A simulated allocation did not fit (CuPy's ``OutOfMemoryError``; registered below)."""


register_oom_exception(OutOfDeviceMemory)


@dataclass
class _Device:
    """One device as this process's pools use it, in bytes."""

    context: bool = False
    held: int = 0  # CuPy-style pool: in use + cached
    in_use: int = 0
    fixed: int = 0  # RMM-style reservation
    fixed_used: int = 0

    @property
    def cached(self) -> int:
        return self.held - self.in_use

    def footprint(self, context_bytes: int) -> int:
        """What NVML reports for this process on this device."""
        return (context_bytes if self.context else 0) + self.held + self.fixed


@dataclass
class _Session:
    """One ``fake_gpus`` state directory as this process sees it.

    The CUDA -> NVML mapping is fixed when the session starts, as CUDA fixes it at init.
    """

    path: Path
    named: str  # the environment's text naming it: a new session is opened when it changes
    nvml: list[int]  # CUDA index -> NVML index (a slot: MIG devices after the GPUs)
    totals: list[int]  # by NVML index (slot)
    context_bytes: int
    pid: int = field(default_factory=os.getpid)
    devices: dict[int, _Device] = field(default_factory=dict)

    @classmethod
    def open(cls, named: str) -> _Session:
        path = Path(named)
        nvml, totals = state.visible_slots(path, visible_from_env())  # MIG devices too
        flags = state.read_flags(path)
        return cls(path, named, nvml, totals, flags.context_bytes)

    def check_device(self, device: int) -> None:
        if isinstance(device, bool) or not isinstance(device, int):
            raise TypeError(f"device must be a CUDA device index (int), got {device!r}")
        if not 0 <= device < len(self.nvml):
            raise ValueError(
                f"device {device} is not visible: this process sees {len(self.nvml)} fake "
                f"GPU(s) (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})"
            )

    def publish(self) -> None:
        """Write this process's device memory for NVML; a forked child or ended session skips."""
        if os.getpid() != self.pid:
            return
        usage = {
            self.nvml[cuda]: dev.footprint(self.context_bytes)
            for cuda, dev in self.devices.items()
            if dev.context
        }
        with contextlib.suppress(FileNotFoundError):  # fake_gpus() ended: directory gone
            state.write_proc(self.path, self.pid, usage)

    def grow(self, cuda: int, dev: _Device, extra: int) -> None:
        """Check that ``extra`` more bytes fit on the device, releasing the cache if needed.

        CuPy does the same on an out-of-memory error: free all cached blocks, retry once.
        """
        if extra == 0:
            return
        index = self.nvml[cuda]
        others = sum(
            usage.get(index, 0)
            for pid, usage in state.read_procs(self.path).items()
            if pid != self.pid
        )
        total = self.totals[index]
        if others + dev.footprint(self.context_bytes) + extra > total and dev.cached:
            dev.held = dev.in_use
            self.publish()
        mine = dev.footprint(self.context_bytes)
        if others + mine + extra > total:
            raise OutOfDeviceMemory(
                f"out of memory allocating {extra} bytes on fake GPU {cuda} (NVML index "
                f"{index}): {max(0, total - others - mine)} of {total} bytes free"
            )


class SimulatedPool:
    """The per-process pool behind ``device_alloc``, as the guard sees it.

    Implements :class:`accelsched.devices.DevicePool`; registered with
    ``register_pool`` when first used. Buffers freed by garbage collection may be
    finalized in any thread, even one that holds the pool's lock, so releases are queued
    and applied by whoever holds the lock next (or at once when it is free).
    """

    name = "simulated"

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._session: _Session | None = None
        self._pending: collections.deque[tuple[_Session, int, int, bool]] = collections.deque()

    # ---- DevicePool ----

    def active(self) -> bool:
        session = self._session
        return session is not None and bool(session.devices)

    def free_all(self) -> int:
        with self._lock:
            self._drain()
            session = self._session
            if session is None:
                return 0
            released = sum(dev.cached for dev in session.devices.values())
            for dev in session.devices.values():
                dev.held = dev.in_use
            session.publish()
        self._flush()
        return released

    def stats(self, device: int) -> PoolStats:
        session = self._session
        dev = None if session is None else session.devices.get(device)
        if dev is None or not (dev.held or dev.fixed):
            return _NOTHING  # (the guard asks after every GPU task: no new object)
        return PoolStats(
            held=dev.held + dev.fixed,
            cached=dev.cached,
            fixed=dev.fixed,
            fixed_free=dev.fixed - dev.fixed_used,
        )

    def ended(self) -> None:
        """The ``fake_gpus`` of this process ended: its memory went with its state
        directory, nothing to report. (Its children's sessions end with them: the
        guard, which asks after every GPU task, reads no environment.) No lock: a
        session ended by the garbage collector may end in a thread that holds it."""
        self._session = None

    # ---- used by the module functions ----

    def _current(self) -> _Session:
        """The session of the state directory now in the environment (lock held)."""
        named = os.environ.get(state.ENV_DIR)
        if not named:
            raise RuntimeError(
                "no fake GPUs here: use accelsched.testing.fake_gpus() around this code, "
                "or call it in a process started inside fake_gpus()"
            )
        if self._session is None or self._session.named != named:
            self._session = _Session.open(named)
        return self._session

    def allocate(self, nbytes: int, device: int) -> tuple[_Session, bool]:
        """Take ``nbytes`` on ``device``; return the session and whether the fixed pool paid."""
        with self._lock:
            self._drain()
            session = self._current()
            session.check_device(device)
            dev = session.devices.setdefault(device, _Device())
            context = 0 if dev.context else session.context_bytes
            fixed = dev.fixed > 0 and dev.fixed - dev.fixed_used >= nbytes
            grows = not fixed and dev.cached < nbytes
            session.grow(device, dev, context + (nbytes if grows else 0))
            if fixed:
                dev.fixed_used += nbytes
            else:
                dev.held += nbytes if grows else 0
                dev.in_use += nbytes
            dev.context = True
            session.publish()
        self._flush()
        return session, fixed

    def visible(self) -> int:
        """How many fake GPUs this process sees (its CUDA device count)."""
        with self._lock:
            return len(self._current().nvml)

    def reserve(self, nbytes: int, device: int) -> None:
        with self._lock:
            self._drain()
            session = self._current()
            session.check_device(device)
            dev = session.devices.setdefault(device, _Device())
            if dev.fixed:
                if dev.fixed != nbytes:
                    raise ValueError(
                        f"fake GPU {device} already has a fixed pool of {dev.fixed} bytes; "
                        f"like RMM's, it cannot be resized to {nbytes}"
                    )
                return
            session.grow(device, dev, nbytes + (0 if dev.context else session.context_bytes))
            dev.fixed = nbytes
            dev.context = True
            session.publish()
        self._flush()

    def create_context(self, device: int) -> None:
        with self._lock:
            self._drain()
            session = self._current()
            session.check_device(device)
            dev = session.devices.setdefault(device, _Device())
            if not dev.context:
                session.grow(device, dev, session.context_bytes)
                dev.context = True
                session.publish()
        self._flush()

    def release(self, session: _Session, device: int, nbytes: int, fixed: bool) -> None:
        """Give a buffer's bytes back to its pool (called by finalizers)."""
        self._pending.append((session, device, nbytes, fixed))
        self._flush()

    def _drain(self) -> None:
        """Apply queued releases (lock held)."""
        touched = []
        while self._pending:
            session, device, nbytes, fixed = self._pending.popleft()
            dev = session.devices[device]
            if fixed:
                dev.fixed_used -= nbytes
            else:
                dev.in_use -= nbytes
            touched.append(session)
        for session in {id(s): s for s in touched}.values():
            session.publish()

    def _flush(self) -> None:
        while self._pending and self._lock.acquire(blocking=False):
            try:
                self._drain()
            finally:
                self._lock.release()


_POOL: SimulatedPool | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> SimulatedPool:
    """This process's pool, created and registered with the guard on first use."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = SimulatedPool()
            register_pool(_POOL)
        return _POOL


def session_ended() -> None:
    """The ``fake_gpus`` session of this process ended (:meth:`SimulatedPool.ended`)."""
    if _POOL is not None:
        _POOL.ended()


#: What a device nothing is held on reports (shared: ``PoolStats`` is frozen).
_NOTHING = PoolStats()


def _after_fork() -> None:
    """A forked child owns none of its parent's device memory (nor its CUDA context).
    The pool object stays (registered with the guard) but forgets everything; the
    parent's buffers, if released in the child, only touch their own old session."""
    global _POOL_LOCK
    _POOL_LOCK = threading.Lock()
    if _POOL is not None:
        _POOL._reset()


os.register_at_fork(after_in_child=_after_fork)
