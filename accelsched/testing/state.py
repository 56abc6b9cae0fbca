"""The state directory shared by every process that sees the fake GPUs.

The fake NVML library (C), its pure-Python stand-in and the simulated pool all meet in
one directory of tiny text files, named by ``ACCELSCHED_FAKE_NVML_DIR`` and re-read on
every query: that is what lets a client, a scheduler and nanny-started workers agree on
the devices and on who holds how much memory, with no server to keep alive.

``devices``
    One line per device, NVML index = line order: ``<uuid>\\t<name>\\t<total_bytes>``.
``flags`` (optional)
    ``no_process_memory`` (per-process memory not available, as under WDDM or some
    containers), ``pid_offset <n>`` (reported pids = real pid + n, as in a container
    without the host PID namespace), ``context_bytes <n>`` (what a CUDA context costs),
    ``fault <nvml_index> <kind>`` (injected NVML errors, see :data:`FAULT_KINDS`).
``proc/<pid>``
    ``<nvml_index> <bytes>`` per device the process has a context on, bytes including
    the context. Written atomically; the file of a dead pid is ignored, as the driver
    frees a dead process's memory.
"""

from __future__ import annotations

import errno
import os
import secrets
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "ENV_DIR",
    "ENV_STANDIN",
    "DEFAULT_CONTEXT_BYTES",
    "FakeDevice",
    "Flags",
    "state_dir",
    "new_uuid",
    "read_devices",
    "write_devices",
    "read_flags",
    "write_flags",
    "alive",
    "read_procs",
    "write_proc",
    "device_used",
]

ENV_DIR = "ACCELSCHED_FAKE_NVML_DIR"
ENV_STANDIN = "ACCELSCHED_FAKE_NVML_STANDIN"
DEFAULT_CONTEXT_BYTES = 64 * 2**20


@dataclass(frozen=True)
class FakeDevice:
    uuid: str
    name: str
    total: int


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


def new_uuid() -> str:
    """A random UUID in NVML's form, ``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx``."""
    h = secrets.token_hex(16)
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def _atomic_write(path: Path, text: str) -> None:
    """Readers in other processes must never see half a file: write aside, then rename."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def read_devices(path: Path) -> list[FakeDevice]:
    devices = []
    for line in (path / "devices").read_text().splitlines():
        parts = line.split("\t")
        if len(parts) == 3:
            devices.append(FakeDevice(parts[0], parts[1], int(parts[2])))
    return devices


def write_devices(path: Path, devices: list[FakeDevice]) -> None:
    _atomic_write(path / "devices", "".join(f"{d.uuid}\t{d.name}\t{d.total}\n" for d in devices))


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


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (EPERM means it runs under another user)."""
    try:
        os.kill(pid, 0)
    except OSError as e:
        return e.errno != errno.ESRCH
    return True


def read_procs(path: Path) -> dict[int, dict[int, int]]:
    """Live processes' device memory: ``{pid: {nvml_index: bytes}}``, by pid."""
    out: dict[int, dict[int, int]] = {}
    try:
        entries = sorted(int(p.name) for p in (path / "proc").iterdir() if p.name.isdigit())
    except FileNotFoundError:
        return out
    for pid in entries:
        if pid <= 0 or not alive(pid):
            continue
        try:
            text = (path / "proc" / str(pid)).read_text()
        except FileNotFoundError:
            continue
        usage: dict[int, int] = {}
        for line in text.splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
                usage.setdefault(int(parts[0]), int(parts[1]))
        out[pid] = usage
    return out


def write_proc(path: Path, pid: int, usage: Mapping[int, int]) -> None:
    """Publish one process's device memory; an empty mapping removes its file."""
    target = path / "proc" / str(pid)
    if not usage:
        target.unlink(missing_ok=True)
        return
    _atomic_write(target, "".join(f"{i} {n}\n" for i, n in sorted(usage.items())))


def device_used(path: Path, index: int) -> int:
    """Device memory used on NVML device ``index``, as NVML reports it."""
    return sum(usage.get(index, 0) for usage in read_procs(path).values())
