"""The state directory shared by every process that sees the fake GPUs.

The fake NVML library (C), its pure-Python stand-in and the simulated pool all meet in
one directory of tiny text files, named by ``ACCELSCHED_FAKE_NVML_DIR`` and re-read on
every query: that is what lets a client, a scheduler and nanny-started workers agree on
the devices and on who holds how much memory, with no server to keep alive.

``devices``
    One line per device, NVML index = line order: ``<uuid>\\t<name>\\t<total_bytes>``,
    and ``\\tmig`` for a GPU in MIG mode.
``mig`` (optional)
    One line per MIG device (a GPU instance with one compute instance), in the order its
    parent enumerates them: ``<parent_index>\\t<MIG-uuid>\\t<name>\\t<total_bytes>\\t<gi>\\t<ci>``.
``flags`` (optional)
    ``no_process_memory`` (per-process memory not available, as under WDDM or some
    containers), ``pid_offset <n>`` (reported pids = real pid + n, as in a container
    without the host PID namespace), ``context_bytes <n>`` (what a CUDA context costs),
    ``fault <nvml_index> <kind>`` (injected NVML errors, see :data:`FAULT_KINDS`).
``proc/<pid>``
    ``start <ticks>`` first where the writer's start time is known (Linux: field 22 of
    ``/proc/<pid>/stat``), then ``<slot> <bytes>`` per device the process has a context
    on, bytes including the context. A slot is a GPU's NVML index, or ``count + k`` for
    the k-th MIG device of ``mig`` (:func:`read_slots`). Written atomically. The file of
    a process that has ended is ignored, as the driver frees an ended process's memory:
    a dead pid, a zombie (it has exited; the driver does not wait for its reaping), or
    a pid now used by another process (its start time differs: pids are reused, and
    soon where ``pid_max`` is 32768).
"""

from __future__ import annotations

import os
import secrets
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from accelsched.devices import resolve_devices
from accelsched.testing.liveness import alive, exists, writer_start

__all__ = [
    "ENV_DIR",
    "ENV_STANDIN",
    "DEFAULT_CONTEXT_BYTES",
    "FakeDevice",
    "FakeMig",
    "Flags",
    "state_dir",
    "new_uuid",
    "read_devices",
    "write_devices",
    "read_migs",
    "write_migs",
    "read_slots",
    "visible_slots",
    "read_flags",
    "write_flags",
    "read_procs",
    "write_proc",
    "device_used",
]

ENV_DIR = "ACCELSCHED_FAKE_NVML_DIR"
ENV_STANDIN = "ACCELSCHED_FAKE_NVML_STANDIN"
DEFAULT_CONTEXT_BYTES = 64 * 2**20


@dataclass(frozen=True)
class FakeDevice:
    """A simulated GPU; ``mig``: in MIG mode (CUDA uses its MIG devices, not itself)."""

    uuid: str
    name: str
    total: int
    mig: bool = False
    capability: tuple[int, int] = (9, 0)  # CUDA compute capability (major, minor)


@dataclass(frozen=True)
class FakeMig:
    """A simulated MIG device: one GPU instance (``gpu_instance``) of GPU ``parent`` (its
    NVML index) with one compute instance, ``total`` bytes of its own memory."""

    uuid: str
    name: str
    total: int
    parent: int
    gpu_instance: int
    compute_instance: int = 0


#: Injected NVML faults on one device: ``all`` (every device query fails with
#: NVML_ERROR_UNKNOWN), ``memory`` / ``processes`` (only memory info / only process lists
#: fail), ``lost`` (every query fails with NVML_ERROR_GPU_IS_LOST).
FAULT_KINDS = ("all", "memory", "processes", "lost")


@dataclass(frozen=True)
class Flags:
    """Ways the fake driver departs from the plain case; see the module docstring."""

    process_memory: bool = True
    pid_offset: int = 0
    context_bytes: int = DEFAULT_CONTEXT_BYTES
    faults: frozenset[tuple[int, str]] = frozenset()  # (NVML index, kind)


def state_dir(env: Mapping[str, str] | None = None) -> Path | None:
    """The state directory named by the environment, or None outside ``fake_gpus``."""
    value = (os.environ if env is None else env).get(ENV_DIR)
    return Path(value) if value else None


def new_uuid(prefix: str = "GPU") -> str:
    """A random UUID in NVML's form, ``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx``
    (``prefix="MIG"`` for a MIG device, as drivers from R470 on name them)."""
    h = secrets.token_hex(16)
    return f"{prefix}-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def _atomic_write(path: Path, text: str) -> None:
    """Readers in other processes must never see half a file: write aside, then rename."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def read_devices(path: Path) -> list[FakeDevice]:
    devices = []
    for line in (path / "devices").read_text().splitlines():
        parts = line.split("\t")
        if 3 <= len(parts) <= 5:
            mig = len(parts) >= 4 and parts[3] == "mig"
            major, _, minor = (parts[4] if len(parts) == 5 else "9.0").partition(".")
            capability = (int(major), int(minor))
            devices.append(FakeDevice(parts[0], parts[1], int(parts[2]), mig, capability))
    return devices


def write_devices(path: Path, devices: list[FakeDevice]) -> None:
    _atomic_write(
        path / "devices",
        "".join(
            f"{d.uuid}\t{d.name}\t{d.total}\t{'mig' if d.mig else 'whole'}"
            f"\t{d.capability[0]}.{d.capability[1]}\n"
            for d in devices
        ),
    )


#: What ``nvmlDeviceGetMaxMigDeviceCount`` answers (A100, H100, H200).
MAX_MIG_PER_GPU = 7
#: MIG devices over all GPUs the simulated library holds (fakenvml.c's ``MAX_MIGS``).
MAX_MIGS = 128


def read_migs(path: Path, devices: list[FakeDevice] | None = None) -> list[FakeMig]:
    """The MIG devices, as the fake library reads them: only under GPUs in MIG mode, at
    most :data:`MAX_MIG_PER_GPU` each."""
    if devices is None:
        devices = read_devices(path)
    try:
        lines = (path / "mig").read_text().splitlines()
    except FileNotFoundError:
        return []
    out: list[FakeMig] = []
    for line in lines:
        parts = line.split("\t")
        if len(parts) != 6 or not all(p.isdigit() for p in (parts[0], *parts[3:])):
            continue
        parent = int(parts[0])
        if parent >= len(devices) or not devices[parent].mig:
            continue
        if sum(1 for m in out if m.parent == parent) >= MAX_MIG_PER_GPU:
            continue
        out.append(FakeMig(parts[1], parts[2], int(parts[3]), parent, int(parts[4]), int(parts[5])))
    return out


def write_migs(path: Path, migs: list[FakeMig]) -> None:
    _atomic_write(
        path / "mig",
        "".join(
            f"{m.parent}\t{m.uuid}\t{m.name}\t{m.total}\t{m.gpu_instance}\t{m.compute_instance}\n"
            for m in migs
        ),
    )


def read_slots(path: Path) -> tuple[list[FakeDevice], list[FakeMig]]:
    """The GPUs and the MIG devices; the slot of MIG device k is ``len(gpus) + k``."""
    devices = read_devices(path)
    return devices, read_migs(path, devices)


def visible_slots(path: Path, entries: list[str] | None) -> tuple[list[int], list[int]]:
    """For a process whose ``CUDA_VISIBLE_DEVICES`` gives ``entries``: the slot of each
    CUDA device, in CUDA order (as CUDA enumerates, one MIG device at most), and every
    slot's total bytes."""
    devices, migs = read_slots(path)
    under: dict[int, list[str]] = {i: [] for i, d in enumerate(devices) if d.mig}
    for m in migs:
        under[m.parent].append(m.uuid)
    slot = {m.uuid: len(devices) + k for k, m in enumerate(migs)}
    cuda = [
        v.nvml_index if v.mig_uuid is None else slot[v.mig_uuid]
        for v in resolve_devices(entries, [d.uuid for d in devices], under)
    ]
    return cuda, [d.total for d in devices] + [m.total for m in migs]


def read_flags(path: Path) -> Flags:
    try:
        lines = (path / "flags").read_text().splitlines()
    except FileNotFoundError:
        return Flags()
    values: dict[str, str] = {}
    faults: set[tuple[int, str]] = set()
    for line in lines:
        key, _, value = line.strip().partition(" ")
        if key == "fault":
            index, _, kind = value.strip().partition(" ")
            if index.isdigit() and kind.strip() in FAULT_KINDS:
                faults.add((int(index), kind.strip()))
            continue
        values[key] = value.strip()
    return Flags(
        process_memory="no_process_memory" not in values,
        pid_offset=int(values.get("pid_offset") or 0),
        context_bytes=int(values.get("context_bytes") or DEFAULT_CONTEXT_BYTES),
        faults=frozenset(faults),
    )


def write_flags(path: Path, flags: Flags) -> None:
    lines = [] if flags.process_memory else ["no_process_memory"]
    lines += [f"pid_offset {flags.pid_offset}", f"context_bytes {flags.context_bytes}"]
    lines += [f"fault {index} {kind}" for index, kind in sorted(flags.faults)]
    _atomic_write(path / "flags", "".join(line + "\n" for line in lines))


def read_procs(path: Path) -> dict[int, dict[int, int]]:
    """Live processes' device memory: ``{pid: {nvml_index: bytes}}``, by pid."""
    out: dict[int, dict[int, int]] = {}
    try:
        entries = sorted(int(p.name) for p in (path / "proc").iterdir() if p.name.isdigit())
    except FileNotFoundError:
        return out
    for pid in entries:
        if pid <= 0 or not exists(pid):  # most records left behind are of dead pids
            continue
        try:
            text = (path / "proc" / str(pid)).read_text()
        except FileNotFoundError:
            continue
        started: int | None = None
        usage: dict[int, int] = {}
        for line in text.splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[0] == "start" and parts[1].isdigit():
                started = int(parts[1])
            elif len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
                usage.setdefault(int(parts[0]), int(parts[1]))
        if alive(pid, started):
            out[pid] = usage
    return out


def write_proc(path: Path, pid: int, usage: Mapping[int, int]) -> None:
    """Publish one process's device memory; an empty mapping removes its file."""
    target = path / "proc" / str(pid)
    if not usage:
        target.unlink(missing_ok=True)
        return
    started = writer_start(pid)
    head = "" if started is None else f"start {started}\n"
    _atomic_write(target, head + "".join(f"{i} {n}\n" for i, n in sorted(usage.items())))


def device_used(path: Path, slot: int, count: int | None = None) -> int:
    """Device memory used in ``slot``, as NVML reports it; with ``count`` (the number of
    GPUs), a GPU's slot also sums the slots of its MIG devices."""
    slots = {slot}
    if count is not None and slot < count:
        migs = read_migs(path)
        slots |= {count + k for k, m in enumerate(migs) if m.parent == slot}
    return sum(n for usage in read_procs(path).values() for s, n in usage.items() if s in slots)
