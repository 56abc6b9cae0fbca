"""What the monitor answers: a device this process can use, and a memory reading.

Plain records, shared by the monitor (:mod:`accelsched.devices.nvml`), the decisions that
read them (:mod:`accelsched.policy`) and the worker's parts; no NVML import.
"""

from __future__ import annotations

from dataclasses import dataclass

from accelsched.protocol import DeviceRecord

__all__ = ["DeviceInfo", "MemoryReading"]


@dataclass(frozen=True)
class DeviceInfo:
    """One device this process can use: ``index`` is its CUDA index here.

    For a MIG device, ``uuid``, ``name`` and ``memory`` are the MIG device's own,
    ``nvml_index`` is its parent GPU's and ``parent`` the parent's UUID (None otherwise).
    ``capability``: CUDA compute capability (major, minor), None when NVML did not say.
    """

    index: int
    nvml_index: int
    uuid: str
    name: str
    memory: int
    parent: str | None = None
    capability: tuple[int, int] | None = None

    @property
    def mig(self) -> bool:
        return self.parent is not None

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
