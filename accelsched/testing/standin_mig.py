"""The MIG queries of the pure-Python NVML stand-in: the same answers as the fake
library (``fakenvml.c``), for the monitor on machines that cannot build it."""

from __future__ import annotations

import ctypes

import pynvml

from accelsched.testing import state
from accelsched.testing.standin_handles import StandinHandle, Target, device, fail

__all__ = [
    "nvmlDeviceGetMigMode",
    "nvmlDeviceGetMaxMigDeviceCount",
    "nvmlDeviceGetMigDeviceHandleByIndex",
    "nvmlDeviceGetDeviceHandleFromMigDeviceHandle",
    "nvmlDeviceIsMigDeviceHandle",
    "nvmlDeviceGetGpuInstanceId",
    "nvmlDeviceGetComputeInstanceId",
]


def _mig_parent(handle: StandinHandle) -> Target:
    """A GPU in MIG mode, or NOT_SUPPORTED (a GPU without MIG, or a MIG device)."""
    t = device(handle)
    if t.mig is not None or not t.gpu.mig:
        fail(pynvml.NVML_ERROR_NOT_SUPPORTED)
    return t


def nvmlDeviceGetMigMode(handle: StandinHandle) -> list[int]:
    _mig_parent(handle)
    return [pynvml.NVML_DEVICE_MIG_ENABLE, pynvml.NVML_DEVICE_MIG_ENABLE]


def nvmlDeviceGetMaxMigDeviceCount(handle: StandinHandle) -> int:
    _mig_parent(handle)
    return state.MAX_MIG_PER_GPU


def nvmlDeviceGetMigDeviceHandleByIndex(handle: StandinHandle, index: int) -> StandinHandle:
    t = _mig_parent(handle)
    if not 0 <= index < state.MAX_MIG_PER_GPU:
        fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    mine = [k for k, m in enumerate(state.read_migs(t.path)) if m.parent == handle.index]
    if index >= len(mine):
        fail(pynvml.NVML_ERROR_NOT_FOUND)
    return StandinHandle(handle.index, mine[index])


def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(handle: StandinHandle) -> StandinHandle:
    if device(handle).mig is None:
        fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    return StandinHandle(handle.index)


def nvmlDeviceIsMigDeviceHandle(handle: StandinHandle) -> ctypes.c_uint:
    """pynvml returns the ctypes value itself here (read ``.value``); so does this."""
    return ctypes.c_uint(device(handle).mig is not None)


def _instance(handle: StandinHandle) -> state.FakeMig:
    mig = device(handle).mig
    if mig is None:
        fail(pynvml.NVML_ERROR_NOT_SUPPORTED)
    return mig


def nvmlDeviceGetGpuInstanceId(handle: StandinHandle) -> int:
    return _instance(handle).gpu_instance


def nvmlDeviceGetComputeInstanceId(handle: StandinHandle) -> int:
    return _instance(handle).compute_instance
