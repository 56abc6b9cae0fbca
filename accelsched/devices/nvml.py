"""The *monitor* seam: what NVML says about this process's devices.

Every NVML question accelsched asks goes through :class:`NVMLMonitor`: the inventory a
worker reports, the device memory its leak check reads, the context check for tasks that
did not ask for a GPU. Nothing else imports ``pynvml``.

No driver, no ``libnvidia-ml.so.1`` or no ``pynvml`` means zero GPUs: one log line, never
an exception. MIG devices are found under their parent GPU (NVML does not count them)
and stand for it as CUDA does (:func:`resolve_devices`): a
worker's device is then the MIG device, with its own UUID, memory and processes.

The NVML library is passed in by name (:mod:`accelsched.devices.gpu_memory`).

``CUDA_VISIBLE_DEVICES``: NVML ignores it and numbers devices physically; CUDA numbers
the visible ones from 0 in the order listed. Everything in accelsched that talks to CUDA
(leases, ``current_device()``) uses CUDA indices; everything that talks to NVML uses
NVML indices; :func:`resolve_devices` is the one place that maps between them.

MIG: NVML lists a MIG device (``MIG-<uuid>``) under its parent GPU, not in the device
count. CUDA runs work on MIG devices, never on a GPU in MIG mode as a whole, and a CUDA
process enumerates **one MIG device at most** ("only enumeration of a single MIG
instance is supported", NVIDIA's MIG user guide, for CUDA 11/R450 and CUDA 12/R525;
``CUDA_VISIBLE_DEVICES=MIG-a,MIG-b`` gives ``cudaGetDeviceCount() == 1``). So
:func:`resolve_devices` keeps the first MIG device it meets and leaves out later ones,
with a warning; GPUs not in MIG mode listed around it stay visible.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from accelsched.devices.gpu_memory import load_backend
from accelsched.protocol import DeviceRecord

__all__ = [
    "DeviceInfo",
    "MemoryReading",
    "NVMLMonitor",
    "Visible",
    "resolve_devices",
    "visible_from_env",
]

logger = logging.getLogger(__name__)

_init_lock = threading.Lock()
_logged: set[str] = set()


@dataclass(frozen=True)
class DeviceFacts:
    """What NVML verified of one device: the attributes a requirement is checked on
    (:mod:`accelsched.policy.requirements`)."""

    name: str
    memory: int  # total bytes
    capability: tuple[int, int] | None = None  # None: NVML did not say
    mig: bool = False


@dataclass(frozen=True, kw_only=True)
class DeviceInfo(DeviceFacts):
    """One device this process can use, as NVML verified it: what requirements are
    checked on, and where it is (``index``: its CUDA index here; ``nvml_index``: its
    GPU's, a MIG device's parent's). A MIG device's ``uuid``, ``name`` and ``memory``
    are its own; ``parent`` is its GPU's UUID (None for a whole GPU)."""

    index: int
    nvml_index: int
    uuid: str
    parent: str | None = None

    def as_dict(self) -> DeviceRecord:
        """The device as a guard reports it to the scheduler (``accelsched_inventory``)."""
        return {
            "index": self.index,
            "uuid": self.uuid,
            "name": self.name,
            "memory": self.memory,
            "capability": None if self.capability is None else list(self.capability),
            "mig": self.mig,
        }


@dataclass(frozen=True)
class MemoryReading:
    """This process's device memory on one device.

    ``exact`` is False when NVML gave no per-process figure (``usedGpuMemory`` None,
    common under MIG and some virtualised GPUs) or listed no entry with our pid (in a
    container without the host PID namespace NVML reports host pids). Then ``nbytes`` is
    the device-wide used memory: other processes on the device are counted in, and a
    baseline taken at start absorbs them as long as they stay steady.
    """

    nbytes: int
    exact: bool
    has_context: bool | None
    #: The figure is this process's alone: exact, or the only process NVML lists on the
    #: device (a container's pid namespace, a MIG device without per-process figures).
    #: The guard draws no conclusion from a reading that is not attributable.
    attributable: bool = True


class NVMLMonitor:
    """Devices visible to this process, through NVML, in CUDA order.

    ``env`` defaults to ``os.environ`` (``CUDA_VISIBLE_DEVICES`` decides what is visible).
    """

    def __init__(self, env: Mapping[str, str] | None = None, pid: int | None = None) -> None:
        self.pid = os.getpid() if pid is None else pid
        self._env = env
        self._nvml: Any = None
        self.reason: str | None = None
        self._devices: list[DeviceInfo] | None = None
        #: CUDA index -> (NVML index, handle or None, MIG UUID or None, its GPU's UUID or
        #: "" when that did not answer): every device CUDA enumerates here; the handle is
        #: looked up again while None (lost when listed)
        self._found: dict[int, tuple[int, Any, str | None, str]] = {}
        self._left_out: set[int] = set()  # those that did not answer when listed

    # --- availability -----------------------------------------------------------------

    def _init(self) -> Any:
        if self._nvml is not None or self.reason is not None:
            return self._nvml
        with _init_lock:
            try:
                nvml = load_backend()
            except ImportError as exc:
                if exc.name == "pynvml":
                    return self._unavailable("pynvml is not installed (pip install nvidia-ml-py)")
                return self._unavailable(f"the NVML backend cannot be imported: {exc}")
            except ValueError as exc:  # a bad accelsched.nvml-backend
                return self._unavailable(str(exc))
            try:
                nvml.nvmlInit()
            except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
                return self._unavailable(f"NVML unavailable ({_describe(exc)})")
            self._nvml = nvml
            return nvml

    def _unavailable(self, reason: str) -> None:
        self.reason = reason
        if reason not in _logged:
            _logged.add(reason)
            logger.info("accelsched: no GPUs in this process: %s", reason)

    @property
    def available(self) -> bool:
        return self._init() is not None

    # --- inventory --------------------------------------------------------------------

    def devices(self) -> list[DeviceInfo]:
        """The devices this process may use (``CUDA_VISIBLE_DEVICES`` applied)."""
        if self._devices is None:
            nvml = self._init()
            try:
                self._devices = [] if nvml is None else self._list(nvml)
            except Exception as exc:
                self._unavailable(f"NVML failed while listing devices ({_describe(exc)})")
                self._devices = []
        return self._devices

    def _list(self, nvml: Any) -> list[DeviceInfo]:
        devices = []
        # a lost GPU fails even its handle lookup: it alone is left out
        handles = [
            _ask(None, nvml.nvmlDeviceGetHandleByIndex, i, warn=f"NVML device {i} gives no handle")
            for i in range(nvml.nvmlDeviceGetCount())
        ]
        # a UUID that does not answer is "": the GPU can still be named by index
        uuids = [
            "" if h is None else _ask("", lambda h=h: _text(nvml.nvmlDeviceGetUUID(h)))
            for h in handles
        ]
        # a GPU (or library) without MIG answers NOT_SUPPORTED, or lacks the function
        enabled = getattr(nvml, "NVML_DEVICE_MIG_ENABLE", 1)
        migs = {
            i: _migs(nvml, h)
            for i, h in enumerate(handles)
            if h is not None and _ask(None, lambda h=h: nvml.nvmlDeviceGetMigMode(h)[0]) == enabled
        }
        order = resolve_devices(
            visible_from_env(self._env), uuids, {i: list(m) for i, m in migs.items()}
        )
        for cuda_index, visible in enumerate(order):  # CUDA's numbering, failing devices included
            i, mig = visible.nvml_index, visible.mig_uuid
            self._found[cuda_index] = (
                i,
                handles[i] if mig is None else migs[i][mig],
                mig,
                uuids[i],
            )
            try:
                devices.append(self._describe(cuda_index))
            except Exception as exc:  # this device does not answer: not ours to use
                logger.warning(
                    "accelsched: GPU %d (NVML %d) does not answer NVML and is left out: %s",
                    cuda_index,
                    i,
                    _describe(exc),
                )
                self._left_out.add(cuda_index)
        return devices

    @property
    def left_out(self) -> list[int]:
        """CUDA indices of the devices visible here that did not answer NVML when they
        were listed (:meth:`devices` leaves them out), until :meth:`adopt` takes one."""
        self.devices()
        return sorted(self._left_out)

    def query(self, index: int) -> DeviceInfo:
        """Ask NVML again about the left-out device with CUDA index ``index``: its
        description when it answers every query the guard makes; raises otherwise."""
        self.devices()
        return self._describe(index)

    def adopt(self, info: DeviceInfo) -> None:
        """A left-out device answers again (see :meth:`query`): list it from now on."""
        self._left_out.remove(info.index)
        devices = self.devices()
        devices.append(info)
        devices.sort(key=lambda d: d.index)

    def device(self, index: int) -> DeviceInfo:
        for d in self.devices():
            if d.index == index:
                return d
        raise IndexError(f"no visible device with CUDA index {index}")

    def _describe(self, index: int) -> DeviceInfo:
        """Device ``index`` (CUDA's) of those found; raises when it does not answer every
        query the guard makes. Its handle is kept once it answers."""
        nvml = self._nvml
        nvml_index, h, mig, gpu_uuid = self._found[index]
        h = nvml.nvmlDeviceGetHandleByIndex(nvml_index) if h is None else h  # lost when listed
        info = DeviceInfo(
            index=index,
            nvml_index=nvml_index,
            uuid=mig or gpu_uuid or _text(nvml.nvmlDeviceGetUUID(h)),
            name=_text(nvml.nvmlDeviceGetName(h)),
            memory=int(nvml.nvmlDeviceGetMemoryInfo(h).total),
            mig=mig is not None,
            parent=None if mig is None else gpu_uuid,
            # a MIG device has its GPU's; None where NVML does not say (an old driver,
            # a binding without the call): a requirement on it is then not met
            capability=_ask(
                None,
                lambda: tuple(
                    map(
                        int,
                        nvml.nvmlDeviceGetCudaComputeCapability(
                            nvml.nvmlDeviceGetHandleByIndex(nvml_index)
                        ),
                    )
                ),
            ),
        )
        nvml.nvmlDeviceGetComputeRunningProcesses(h)  # the guard's own query
        self._found[index] = (nvml_index, h, mig, gpu_uuid)
        return info

    # --- memory -----------------------------------------------------------------------

    def used(self, index: int) -> int:
        """Device-wide used memory (every process on the device)."""
        self.devices()
        return int(self._nvml.nvmlDeviceGetMemoryInfo(self._found[index][1]).used)

    def process_memory(self, index: int) -> MemoryReading:
        """This process's device memory on the device with CUDA index ``index``."""
        self.devices()
        procs = self._nvml.nvmlDeviceGetComputeRunningProcesses(self._found[index][1])
        if not procs:
            return MemoryReading(0, True, False)  # nobody, so not this process, holds it
        mine = [p for p in procs if p.pid == self.pid]
        if mine and all(p.usedGpuMemory is not None for p in mine):
            return MemoryReading(sum(int(p.usedGpuMemory) for p in mine), True, True)
        has_context: bool | None = True if mine else None
        if len(procs) == 1 and procs[0].usedGpuMemory is not None:
            # one process on the device, under another pid: with exclusive ownership it
            # is this worker seen from the host's pid namespace
            return MemoryReading(int(procs[0].usedGpuMemory), False, has_context, True)
        return MemoryReading(self.used(index), False, has_context, False)


def _ask(default: Any, call: Callable[..., Any], *args: Any, warn: str | None = None) -> Any:
    """``call(*args)``, or ``default`` where NVML raises (logged when ``warn`` says how)."""
    try:
        return call(*args)
    except Exception as exc:
        if warn:
            logger.warning("accelsched: %s: %s", warn, _describe(exc))
        return default


def _migs(nvml: Any, handle: Any) -> dict[str, Any]:
    """The MIG devices of a GPU in MIG mode: UUID -> handle, in NVML's order. An index
    with no MIG device behind it (NOT_FOUND) or one that does not answer is skipped."""
    out: dict[str, Any] = {}
    count = _ask(
        0, nvml.nvmlDeviceGetMaxMigDeviceCount, handle, warn="MIG devices cannot be listed"
    )
    for i in range(int(count)):
        try:
            mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, i)
            out[_text(nvml.nvmlDeviceGetUUID(mig))] = mig
        except Exception:  # NVMLError_NotFound: no MIG device at this index
            continue
    return out


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _describe(exc: BaseException) -> str:
    name = type(exc).__name__
    return f"{name}: {exc}" if str(exc) else name


# --- CUDA_VISIBLE_DEVICES (see the module docstring) ---------------------------------


@dataclass(frozen=True)
class Visible:
    """One CUDA device: the GPU with NVML index ``nvml_index``, or its MIG device
    ``mig_uuid``."""

    nvml_index: int
    mig_uuid: str | None = None


def visible_from_env(env: Mapping[str, str] | None = None) -> list[str] | None:
    """The entries of ``CUDA_VISIBLE_DEVICES``: None (unset) means every device, the
    empty string none."""
    value = (os.environ if env is None else env).get("CUDA_VISIBLE_DEVICES")
    return None if value is None else [part.strip() for part in value.split(",") if part.strip()]


def resolve_devices(
    entries: Sequence[str] | None,
    uuids: Sequence[str],
    migs: Mapping[int, Sequence[str]] | None = None,
) -> list[Visible]:
    """The CUDA devices of a process, in CUDA order.

    ``uuids``: the GPUs' UUIDs by NVML index; ``migs``: for each GPU in MIG mode (its
    NVML index), the UUIDs of its MIG devices by their index under it (none: no MIG).
    Entries are indices, ``GPU-`` UUIDs or unique prefixes, ``MIG-`` UUIDs or unique
    prefixes. A GPU in MIG mode named as a whole (or every device, when ``entries`` is
    None) stands for its first MIG device, as CUDA enumerates it. Only the first MIG
    device met is kept (see the module docstring); a MIG-mode GPU with no MIG device
    adds nothing. Like CUDA, the list ends at the first entry that names no device, or
    names one twice.
    """
    migs = migs or {}
    names: Sequence[str] = [str(i) for i in range(len(uuids))] if entries is None else entries
    out: list[Visible] = []
    seen: set[tuple[int, str | None]] = set()
    mig_taken = False
    for entry in names:
        found = _match(entry, uuids, migs)
        if found is None or (found.nvml_index, found.mig_uuid) in seen:
            logger.warning(
                "CUDA_VISIBLE_DEVICES entry %r names no device (or repeats one); "
                "CUDA ignores it and every entry after it",
                entry,
            )
            break
        seen.add((found.nvml_index, found.mig_uuid))
        if found.nvml_index in migs and found.mig_uuid is None:
            continue  # a GPU in MIG mode without MIG devices: nothing CUDA can use
        if found.mig_uuid is not None:
            if mig_taken:
                logger.warning(
                    "CUDA_VISIBLE_DEVICES entry %r is a second MIG device; a CUDA process "
                    "enumerates one MIG device only, so it is left out",
                    entry,
                )
                continue
            mig_taken = True
        out.append(found)
    return out


def _match(entry: str, uuids: Sequence[str], migs: Mapping[int, Sequence[str]]) -> Visible | None:
    if entry.isascii() and entry.isdigit():  # CUDA reads ASCII digits only ("²", "３": none)
        i = int(entry)
        return _whole(i, migs) if i < len(uuids) else None
    if entry.startswith("MIG-"):
        hits = [
            Visible(parent, uuid)
            for parent, under in migs.items()
            for uuid in under
            if uuid.startswith(entry)
        ]
        exact = [v for v in hits if v.mig_uuid == entry]
        return exact[0] if exact else hits[0] if len(hits) == 1 else None
    needle = entry if entry.startswith("GPU-") else "GPU-" + entry
    gpus = [i for i, u in enumerate(uuids) if u.startswith(needle)]
    return _whole(gpus[0], migs) if len(gpus) == 1 else None


def _whole(index: int, migs: Mapping[int, Sequence[str]]) -> Visible:
    """GPU ``index`` named as a whole: itself, or its first MIG device in MIG mode."""
    under = migs.get(index)
    if under:
        return Visible(index, under[0])
    return Visible(index)
