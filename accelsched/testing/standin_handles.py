"""Handles of the pure-Python NVML stand-in, and the state they name.

Shared by :mod:`accelsched.testing.standin` (the device queries) and
:mod:`accelsched.testing.standin_mig` (the MIG queries): the one place that turns a
handle into the device, the faults and the memory slots the fake library would see.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import pynvml

from accelsched.testing import state

__all__ = ["StandinHandle", "Target", "fail", "devices", "device", "init", "shutdown"]

_lock = threading.Lock()
_refcount = 0


def init() -> None:
    """nvmlInit: one more user of the library (after the caller checked the driver)."""
    global _refcount
    with _lock:
        _refcount += 1


def shutdown() -> None:
    """nvmlShutdown: one user less, or UNINITIALIZED when there is none."""
    global _refcount
    with _lock:
        if _refcount <= 0:
            fail(pynvml.NVML_ERROR_UNINITIALIZED)
        _refcount -= 1


@dataclass(frozen=True)
class StandinHandle:
    """A device handle: what pynvml's opaque pointer is to the C library. ``mig``: the
    line of a MIG device in the state's ``mig`` file (None: the whole GPU ``index``)."""

    index: int
    mig: int | None = None


@dataclass(frozen=True)
class Target:
    """What a valid handle names, read from the state directory."""

    path: Path
    gpu: state.FakeDevice
    mig: state.FakeMig | None
    slots: frozenset[int]  # where proc files count its memory: a GPU's own slot and
    # its MIG devices' slots, or a MIG device's own


def fail(code: int) -> NoReturn:
    raise pynvml.NVMLError(code)


def devices() -> tuple[Path, list[state.FakeDevice]]:
    """The state as an initialized library sees it, or the error the C library returns."""
    path = state.state_dir()
    if _refcount <= 0 or path is None:
        fail(pynvml.NVML_ERROR_UNINITIALIZED)
    try:
        return path, state.read_devices(path)
    except OSError:
        fail(pynvml.NVML_ERROR_UNINITIALIZED)


def device(handle: StandinHandle, kind: str = "") -> Target:
    """The device behind ``handle``, or the error the C library returns, injected faults
    included (``kind``: ``"memory"`` or ``"processes"`` for those queries; a GPU's faults
    reach its MIG devices)."""
    path, gpus = devices()
    if not isinstance(handle, StandinHandle) or not 0 <= handle.index < len(gpus):
        fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    migs = state.read_migs(path, gpus)
    if handle.mig is not None and not (
        0 <= handle.mig < len(migs) and migs[handle.mig].parent == handle.index
    ):
        fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    faults = {k for i, k in state.read_flags(path).faults if i == handle.index}
    if "lost" in faults:
        fail(pynvml.NVML_ERROR_GPU_IS_LOST)
    if "all" in faults or kind in faults:
        fail(pynvml.NVML_ERROR_UNKNOWN)
    if handle.mig is not None:
        slot = frozenset({len(gpus) + handle.mig})
        return Target(path, gpus[handle.index], migs[handle.mig], slot)
    own = {len(gpus) + k for k, m in enumerate(migs) if m.parent == handle.index}
    return Target(path, gpus[handle.index], None, frozenset({handle.index} | own))
