"""A pure-Python stand-in for pynvml, for machines where the fake library cannot be built.

``fake_gpus`` needs a C compiler to build the fake ``libnvidia-ml.so.1`` that the real
pynvml loads. Where none exists (slim CI images), it sets ``ACCELSCHED_FAKE_NVML_STANDIN=1``
and accelsched's monitor uses this module in place of ``pynvml``: the same function names,
return shapes and ``NVMLError`` classes (pynvml's own, so ``except pynvml.NVMLError_...``
works either way) for the subset the monitor calls, reading the same state directory.
Third-party code that imports pynvml itself (distributed's diagnostics, dask-cuda) still
sees no GPU then; only a built library fixes that.

Use it as a module: ``nvml = standin if standin.active() else pynvml``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import pynvml

from accelsched.testing import state

__all__ = [
    "active",
    "StandinHandle",
    "nvmlInit",
    "nvmlInitWithFlags",
    "nvmlShutdown",
    "nvmlErrorString",
    "nvmlSystemGetDriverVersion",
    "nvmlSystemGetNVMLVersion",
    "nvmlSystemGetCudaDriverVersion",
    "nvmlSystemGetCudaDriverVersion_v2",
    "nvmlDeviceGetCount",
    "nvmlDeviceGetHandleByIndex",
    "nvmlDeviceGetHandleByUUID",
    "nvmlDeviceGetIndex",
    "nvmlDeviceGetName",
    "nvmlDeviceGetUUID",
    "nvmlDeviceGetMemoryInfo",
    "nvmlDeviceGetComputeRunningProcesses",
    "nvmlDeviceGetComputeRunningProcesses_v2",
    "nvmlDeviceGetComputeRunningProcesses_v3",
    "nvmlDeviceGetUtilizationRates",
    "nvmlDeviceGetMigMode",
]

DRIVER_VERSION = "555.42.06"
NVML_VERSION = "12.555.42.06"
CUDA_DRIVER_VERSION = 12050

_lock = threading.Lock()
_refcount = 0


def active() -> bool:
    """True when ``fake_gpus`` chose the stand-in and its state directory is set."""
    return os.environ.get(state.ENV_STANDIN) == "1" and state.state_dir() is not None


@dataclass(frozen=True)
class StandinHandle:
    """A device handle: what pynvml's opaque pointer is to the C library."""

    index: int


def _fail(code: int) -> NoReturn:
    raise pynvml.NVMLError(code)


def _devices() -> tuple[Path, list[state.FakeDevice]]:
    """The state as an initialized library sees it, or the error the C library returns."""
    path = state.state_dir()
    if _refcount <= 0 or path is None:
        _fail(pynvml.NVML_ERROR_UNINITIALIZED)
    try:
        return path, state.read_devices(path)
    except OSError:
        _fail(pynvml.NVML_ERROR_UNINITIALIZED)


def _device(handle: StandinHandle, kind: str = "") -> tuple[Path, int, state.FakeDevice]:
    """The device behind ``handle``, or the error the C library returns, injected faults
    included (``kind``: ``"memory"`` or ``"processes"`` for those queries)."""
    path, devices = _devices()
    if not isinstance(handle, StandinHandle) or not 0 <= handle.index < len(devices):
        _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    faults = {k for i, k in state.read_flags(path).faults if i == handle.index}
    if "lost" in faults:
        _fail(pynvml.NVML_ERROR_GPU_IS_LOST)
    if "all" in faults or kind in faults:
        _fail(pynvml.NVML_ERROR_UNKNOWN)
    return path, handle.index, devices[handle.index]


# ---- init / shutdown / errors ----


def nvmlInitWithFlags(flags: int) -> None:
    global _refcount
    path = state.state_dir()
    if path is None or not (path / "devices").is_file():
        _fail(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
    with _lock:
        _refcount += 1


def nvmlInit() -> None:
    nvmlInitWithFlags(0)


def nvmlShutdown() -> None:
    global _refcount
    with _lock:
        if _refcount <= 0:
            _fail(pynvml.NVML_ERROR_UNINITIALIZED)
        _refcount -= 1


def nvmlErrorString(result: int) -> str:
    if result == pynvml.NVML_SUCCESS:
        return "Success"
    return pynvml.NVMLError._errcode_to_string.get(result, "Unknown Error")


# ---- system ----


def nvmlSystemGetDriverVersion() -> str:
    _devices()
    return DRIVER_VERSION


def nvmlSystemGetNVMLVersion() -> str:
    return NVML_VERSION


def nvmlSystemGetCudaDriverVersion() -> int:
    return CUDA_DRIVER_VERSION


def nvmlSystemGetCudaDriverVersion_v2() -> int:
    return CUDA_DRIVER_VERSION


# ---- devices ----


def nvmlDeviceGetCount() -> int:
    return len(_devices()[1])


def nvmlDeviceGetHandleByIndex(index: int) -> StandinHandle:
    if not 0 <= index < len(_devices()[1]):
        _fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    return StandinHandle(index)


def nvmlDeviceGetHandleByUUID(uuid: str | bytes) -> StandinHandle:
    text = uuid.decode() if isinstance(uuid, bytes) else uuid
    for i, device in enumerate(_devices()[1]):
        if device.uuid == text:
            return StandinHandle(i)
    _fail(pynvml.NVML_ERROR_NOT_FOUND)


def nvmlDeviceGetIndex(handle: StandinHandle) -> int:
    return _device(handle)[1]


def nvmlDeviceGetName(handle: StandinHandle) -> str:
    return _device(handle)[2].name


def nvmlDeviceGetUUID(handle: StandinHandle) -> str:
    return _device(handle)[2].uuid


def nvmlDeviceGetMemoryInfo(
    handle: StandinHandle, version: int | None = None
) -> pynvml.c_nvmlMemory_t | pynvml.c_nvmlMemory_v2_t:
    path, index, device = _device(handle, "memory")
    used = state.device_used(path, index)
    free = max(0, device.total - used)
    if not version:
        return pynvml.c_nvmlMemory_t(total=device.total, free=free, used=used)
    if version != pynvml.nvmlMemory_v2:
        _fail(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
    return pynvml.c_nvmlMemory_v2_t(
        version=version, total=device.total, reserved=0, free=free, used=used
    )


def nvmlDeviceGetComputeRunningProcesses_v3(handle: StandinHandle) -> list[Any]:
    path, index, _ = _device(handle, "processes")
    flags = state.read_flags(path)
    not_available = pynvml.NVML_VALUE_NOT_AVAILABLE_uint.value
    return [
        pynvml.nvmlFriendlyObject(
            {
                "pid": (pid + flags.pid_offset) % 2**32,
                "usedGpuMemory": usage[index] if flags.process_memory else None,
                "gpuInstanceId": not_available,
                "computeInstanceId": not_available,
            }
        )
        for pid, usage in state.read_procs(path).items()
        if index in usage
    ]


nvmlDeviceGetComputeRunningProcesses_v2 = nvmlDeviceGetComputeRunningProcesses_v3
nvmlDeviceGetComputeRunningProcesses = nvmlDeviceGetComputeRunningProcesses_v3


def nvmlDeviceGetUtilizationRates(handle: StandinHandle) -> pynvml.c_nvmlUtilization_t:
    _device(handle)
    return pynvml.c_nvmlUtilization_t(gpu=0, memory=0)


def nvmlDeviceGetMigMode(handle: StandinHandle) -> list[int]:
    _device(handle)
    _fail(pynvml.NVML_ERROR_NOT_SUPPORTED)


def __getattr__(name: str) -> Any:
    """pynvml's constants, structs and error classes, looked up on pynvml itself.

    pynvml's other functions come back "missing" (they raise ``NVMLError_FunctionNotFound``,
    as when a library lacks the symbol) rather than reach the real NVML this replaces.
    """
    value = getattr(pynvml, name)  # AttributeError for names pynvml lacks too
    if name.startswith("nvml") and _is_function(value) and name not in _HELPERS:
        return _missing(name)
    return value


_HELPERS = {"nvmlExceptionClass", "nvmlStructToFriendlyObject", "nvmlFriendlyObjectToStruct"}


def _missing(name: str) -> Callable[..., NoReturn]:
    def missing(*args: Any, **kwargs: Any) -> NoReturn:
        _fail(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)

    missing.__name__ = name
    return missing


def _is_function(value: Any) -> bool:
    return callable(value) and not isinstance(value, type)
