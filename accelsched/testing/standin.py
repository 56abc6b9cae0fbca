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
from collections.abc import Callable
from typing import Any, NoReturn

import pynvml

from accelsched.testing import standin_handles, state
from accelsched.testing.standin_handles import StandinHandle, Target, device, devices, fail
from accelsched.testing.standin_mig import (
    nvmlDeviceGetComputeInstanceId,
    nvmlDeviceGetDeviceHandleFromMigDeviceHandle,
    nvmlDeviceGetGpuInstanceId,
    nvmlDeviceGetMaxMigDeviceCount,
    nvmlDeviceGetMigDeviceHandleByIndex,
    nvmlDeviceGetMigMode,
    nvmlDeviceIsMigDeviceHandle,
)

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
    "nvmlDeviceGetCudaComputeCapability",
    "nvmlDeviceGetComputeRunningProcesses",
    "nvmlDeviceGetComputeRunningProcesses_v2",
    "nvmlDeviceGetComputeRunningProcesses_v3",
    "nvmlDeviceGetUtilizationRates",
    "nvmlDeviceGetMigMode",
    "nvmlDeviceGetMaxMigDeviceCount",
    "nvmlDeviceGetMigDeviceHandleByIndex",
    "nvmlDeviceGetDeviceHandleFromMigDeviceHandle",
    "nvmlDeviceIsMigDeviceHandle",
    "nvmlDeviceGetGpuInstanceId",
    "nvmlDeviceGetComputeInstanceId",
]

DRIVER_VERSION = "555.42.06"
NVML_VERSION = "12.555.42.06"
CUDA_DRIVER_VERSION = 12050


def active() -> bool:
    """True when ``fake_gpus`` chose the stand-in and its state directory is set."""
    return os.environ.get(state.ENV_STANDIN) == "1" and state.state_dir() is not None


# ---- init / shutdown / errors ----


def nvmlInitWithFlags(flags: int) -> None:
    path = state.state_dir()
    if path is None or not (path / "devices").is_file():
        fail(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
    standin_handles.init()


def nvmlInit() -> None:
    nvmlInitWithFlags(0)


def nvmlShutdown() -> None:
    standin_handles.shutdown()


def nvmlErrorString(result: int) -> str:
    if result == pynvml.NVML_SUCCESS:
        return "Success"
    return pynvml.NVMLError._errcode_to_string.get(result, "Unknown Error")


# ---- system ----


def nvmlSystemGetDriverVersion() -> str:
    devices()
    return DRIVER_VERSION


def nvmlSystemGetNVMLVersion() -> str:
    return NVML_VERSION


def nvmlSystemGetCudaDriverVersion() -> int:
    return CUDA_DRIVER_VERSION


def nvmlSystemGetCudaDriverVersion_v2() -> int:
    return CUDA_DRIVER_VERSION


# ---- devices ----


def nvmlDeviceGetCount() -> int:
    return len(devices()[1])


def nvmlDeviceGetHandleByIndex(index: int) -> StandinHandle:
    if not 0 <= index < len(devices()[1]):
        fail(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    return StandinHandle(index)


def nvmlDeviceGetHandleByUUID(uuid: str | bytes) -> StandinHandle:
    text = uuid.decode() if isinstance(uuid, bytes) else uuid
    path, gpus = devices()
    for i, gpu in enumerate(gpus):
        if gpu.uuid == text:
            return StandinHandle(i)
    for k, mig in enumerate(state.read_migs(path, gpus)):
        if mig.uuid == text:
            return StandinHandle(mig.parent, k)
    fail(pynvml.NVML_ERROR_NOT_FOUND)


def nvmlDeviceGetIndex(handle: StandinHandle) -> int:
    """A MIG device answers with its parent's index, as the library does."""
    device(handle)
    return handle.index


def nvmlDeviceGetName(handle: StandinHandle) -> str:
    t = device(handle)
    return (t.mig or t.gpu).name


def nvmlDeviceGetUUID(handle: StandinHandle) -> str:
    t = device(handle)
    return (t.mig or t.gpu).uuid


def nvmlDeviceGetCudaComputeCapability(handle: StandinHandle) -> tuple[int, int]:
    """A MIG device answers with its parent GPU's, as the library does."""
    return device(handle).gpu.capability


def nvmlDeviceGetMemoryInfo(
    handle: StandinHandle, version: int | None = None
) -> pynvml.c_nvmlMemory_t | pynvml.c_nvmlMemory_v2_t:
    t = device(handle, "memory")
    total = (t.mig or t.gpu).total
    used = sum(n for usage in state.read_procs(t.path).values() for s, n in _on(usage, t))
    free = max(0, total - used)
    if not version:
        return pynvml.c_nvmlMemory_t(total=total, free=free, used=used)
    if version != pynvml.nvmlMemory_v2:
        fail(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
    return pynvml.c_nvmlMemory_v2_t(version=version, total=total, reserved=0, free=free, used=used)


def _on(usage: dict[int, int], t: Target) -> list[tuple[int, int]]:
    """A process's (slot, bytes) on the target, by slot."""
    return sorted((s, n) for s, n in usage.items() if s in t.slots)


def nvmlDeviceGetComputeRunningProcesses_v3(handle: StandinHandle) -> list[Any]:
    """One entry per process and MIG device, by pid, as the library lists them."""
    t = device(handle, "processes")
    flags = state.read_flags(t.path)
    gpus, migs = state.read_slots(t.path)
    not_available = pynvml.NVML_VALUE_NOT_AVAILABLE_uint.value

    def instance(slot: int) -> tuple[int, int]:
        if slot < len(gpus):
            return not_available, not_available
        m = migs[slot - len(gpus)]
        return m.gpu_instance, m.compute_instance

    out = []
    for pid, usage in state.read_procs(t.path).items():
        on = sorted(_on(usage, t), key=lambda sn: instance(sn[0]))
        for slot, nbytes in on:
            gi, ci = instance(slot)
            fields: dict[str, int | None] = {
                "pid": (pid + flags.pid_offset) % 2**32,
                "usedGpuMemory": nbytes if flags.process_memory else None,
                "gpuInstanceId": gi,
                "computeInstanceId": ci,
            }
            out.append(pynvml.nvmlFriendlyObject(fields))
    return out


nvmlDeviceGetComputeRunningProcesses_v2 = nvmlDeviceGetComputeRunningProcesses_v3
nvmlDeviceGetComputeRunningProcesses = nvmlDeviceGetComputeRunningProcesses_v3


def nvmlDeviceGetUtilizationRates(handle: StandinHandle) -> pynvml.c_nvmlUtilization_t:
    t = device(handle)
    if t.mig is not None or t.gpu.mig:
        fail(pynvml.NVML_ERROR_NOT_SUPPORTED)
    return pynvml.c_nvmlUtilization_t(gpu=0, memory=0)


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
        fail(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)

    missing.__name__ = name
    return missing


def _is_function(value: Any) -> bool:
    return callable(value) and not isinstance(value, type)
