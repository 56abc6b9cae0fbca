"""GPUs on a CPU-only machine, seen through the real pynvml: test GPU scheduling in CI.

Most CI runners have no GPU, yet a pipeline's GPU *scheduling* (which task lands on
which worker and device, what happens when a GPU is missing, leaking or full, when a task
falls back to CPU) is exactly what breaks unnoticed. ``fake_gpus`` makes a CPU machine
look like a GPU machine to everything that asks NVML, in this process and in every
process started inside it (a ``LocalCluster``'s nanny workers, ``subprocess``)::

    from accelsched.testing import fake_gpus, device_alloc

    with fake_gpus(count=2, memory="16GiB") as gpus:
        workers = {  # one nanny worker per fake GPU, as on a GPU machine
            f"gpu-{i}": {"cls": Nanny, "options": {"env": {"CUDA_VISIBLE_DEVICES": str(i)}}}
            for i in range(gpus.count)
        }
        scheduler = {"cls": Scheduler, "options": {"dashboard_address": ":0"}}
        with SpecCluster(workers=workers, scheduler=scheduler) as cluster, Client(cluster):
            ...  # tasks call device_alloc(nbytes) to use (or leak) device memory

(docs/testing.md has it in full: a ``LocalCluster``'s workers would each see both
devices.)

It builds a fake ``libnvidia-ml.so.1`` (a small C file, compiled once into a cache) and
puts it first on ``LD_LIBRARY_PATH``, so the unmodified pynvml, distributed's GPU
diagnostics and accelsched's monitor all read the devices, the memory and the per-process
usage from one shared state directory, which :func:`device_alloc` writes with CuPy's and
RMM's pool semantics. Without a C compiler a pure-Python stand-in
(:mod:`accelsched.testing.standin`) serves accelsched's own monitor, with a warning.

A process whose pynvml already loaded the real NVML keeps it (a loaded library cannot be
replaced); ``fake_gpus`` detects that and warns, and processes it starts still see the
fake GPUs.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import sys
import tempfile
import threading
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

from accelsched import internals
from accelsched.devices import BACKEND_ENV
from accelsched.testing import build, device_memory, nvml_backend, state
from accelsched.testing.buffers import DeviceBuffer, create_context, device_alloc, fixed_pool
from accelsched.testing.checks import (
    MAX_DEVICES as MAX_DEVICES,
)
from accelsched.testing.checks import (
    _check_bool,
    _check_capability,
    _check_context,
    _check_count,
    _check_name,
    _check_pid_offset,
    _parse_size,
    _per_device,
)
from accelsched.testing.device_memory import OutOfDeviceMemory, SimulatedPool
from accelsched.testing.mig import check_mig, mig_devices

__all__ = [
    "FakeGPUs",
    "FakeNVMLWarning",
    "fake_gpus",
    "device_alloc",
    "create_context",
    "fixed_pool",
    "DeviceBuffer",
    "OutOfDeviceMemory",
    "SimulatedPool",
]

_ENV_KEYS = (state.ENV_DIR, state.ENV_STANDIN, BACKEND_ENV, "LD_LIBRARY_PATH")
_active_lock = threading.Lock()
_active = False
_loaded: list[ctypes.CDLL] = []  # keep the fake library loaded for the process's life


class FakeNVMLWarning(UserWarning):
    """The fake GPUs are only partly visible (no compiler, or a real NVML already loaded)."""


@dataclass
class FakeGPUs:
    """A running ``fake_gpus`` session.

    ``env`` holds the variables a process needs to see the fake GPUs, for processes
    started with an explicit environment; processes that inherit ``os.environ`` have
    them already.
    """

    path: Path
    uuids: tuple[str, ...]
    names: tuple[str, ...]
    memory: tuple[int, ...]
    env: dict[str, str]
    library: Path | None  # None when the pure-Python stand-in serves instead
    _flags: state.Flags = field(repr=False)
    #: The MIG devices, every GPU's in NVML order (``mig=`` of :func:`fake_gpus`).
    mig: tuple[state.FakeMig, ...] = ()

    def mig_uuids(self, device: int) -> tuple[str, ...]:
        """UUIDs (``MIG-...``) of the MIG devices of GPU ``device`` (its NVML index)."""
        self._check_device(device)
        return tuple(m.uuid for m in self.mig if m.parent == device)

    def _check_device(self, device: int) -> None:
        if isinstance(device, bool) or not isinstance(device, int):
            raise TypeError(f"fake_gpus: device must be an int, got {device!r}")
        if not 0 <= device < self.count:
            raise ValueError(f"fake_gpus: no device {device!r}; devices are 0..{self.count - 1}")

    @property
    def count(self) -> int:
        return len(self.uuids)

    @property
    def standin(self) -> bool:
        return self.library is None

    def fail(self, device: int, calls: str = "all") -> None:
        """Make NVML fail on fake GPU ``device`` (its NVML index), in every process, from
        the next call on: ``calls="all"`` every device query (NVML_ERROR_UNKNOWN),
        ``"memory"`` or ``"processes"`` only those queries, ``"lost"`` every query with
        NVML_ERROR_GPU_IS_LOST (a GPU that fell off the bus)."""
        self._check_device(device)
        if calls not in state.FAULT_KINDS:
            raise ValueError(
                f"fake_gpus: calls must be one of {', '.join(state.FAULT_KINDS)}, got {calls!r}"
            )
        self._write(replace(self._flags, faults=self._flags.faults | {(device, calls)}))

    def lose(self, device: int) -> None:
        """``fail(device, "lost")``: the GPU fell off the bus."""
        self.fail(device, "lost")

    def recover(self, device: int | None = None) -> None:
        """Undo :meth:`fail` for ``device``, or for every device."""
        if device is not None:
            self._check_device(device)
        faults = {f for f in self._flags.faults if device is not None and f[0] != device}
        self._write(replace(self._flags, faults=frozenset(faults)))

    def _write(self, flags: state.Flags) -> None:
        state.write_flags(self.path, flags)
        self._flags = flags

    def set_flags(
        self,
        *,
        process_memory: bool | None = None,
        pid_offset: int | None = None,
        context_memory: int | str | None = None,
    ) -> None:
        """Change how the fake driver reports, from the next NVML call on, in every process.

        ``context_memory`` only reaches processes that first allocate afterwards (a
        process's pool reads it once).
        """
        flags = self._flags
        if process_memory is not None:
            flags = replace(flags, process_memory=_check_bool(process_memory, "process_memory"))
        if pid_offset is not None:
            flags = replace(flags, pid_offset=_check_pid_offset(pid_offset))
        if context_memory is not None:
            context = _parse_size(context_memory, "context_memory")
            flags = replace(
                flags, context_bytes=_check_context(context, self.memory, context_memory)
            )
        self._write(flags)


@contextmanager
def fake_gpus(
    count: int = 2,
    memory: int | str | Sequence[int | str] = "16GiB",
    *,
    names: str | Sequence[str] | None = None,
    capability: str | Sequence[str] = "9.0",
    context_memory: int | str = "64MiB",
    process_memory: bool = True,
    pid_offset: int = 0,
    mig: Sequence[str] | Sequence[Sequence[str] | None] | None = None,
) -> Iterator[FakeGPUs]:
    """Show ``count`` fake GPUs to this process and every process started inside.

    ``memory`` is each device's total (``"16GiB"``, bytes, or one value per device);
    ``names`` a name for all or one per device; ``capability`` the CUDA compute
    capability NVML reports (``"8.0"``, for all or one per device; a MIG device has its
    GPU's); ``context_memory`` what a CUDA context
    costs a process on a device; ``process_memory=False`` makes NVML report per-process
    memory as not available, and ``pid_offset`` shifts reported pids, as in containers
    without the host PID namespace. ``mig`` puts GPUs in MIG mode with MIG devices
    (``["3g.40gb", "3g.40gb"]`` for every GPU, or one list or None per GPU; see
    :mod:`accelsched.testing.mig`). On exit the environment is restored exactly and the
    state directory removed. Sessions do not nest.
    """
    global _active
    count = _check_count(count)
    totals = _per_device(memory, count, "memory", lambda v: _parse_size(v, "memory", 1))
    if names is None:
        names = "NVIDIA Simulated GPU"
    labels = _per_device(names, count, "names", _check_name)
    capabilities = _per_device(capability, count, "capability", _check_capability)
    partitions = check_mig(mig, count, totals)
    migs = mig_devices(partitions, labels)
    flags = state.Flags(
        process_memory=_check_bool(process_memory, "process_memory"),
        pid_offset=_check_pid_offset(pid_offset),
        context_bytes=_check_context(
            _parse_size(context_memory, "context_memory"), totals, context_memory
        ),
    )
    with _active_lock:
        outer = os.environ.get(state.ENV_DIR)
        if _active or outer:
            raise RuntimeError(
                "fake_gpus() is already active"
                + (f" (ACCELSCHED_FAKE_NVML_DIR={outer})" if outer else "")
                + ": sessions do not nest; use one session with the devices you need"
            )
        _active = True
    saved_env = {key: os.environ.get(key) for key in _ENV_KEYS}
    entered_by = os.getpid()
    saved_nvml = internals.distributed_nvml_state()
    path: Path | None = None
    try:
        path = Path(tempfile.mkdtemp(prefix="accelsched-fake-gpus-"))
        devices = [
            state.FakeDevice(state.new_uuid(), n, t, p is not None, cc)
            for n, t, p, cc in zip(labels, totals, partitions, capabilities, strict=True)
        ]
        state.write_devices(path, devices)
        state.write_migs(path, migs)
        state.write_flags(path, flags)
        (path / "proc").mkdir()
        env = {state.ENV_DIR: str(path), BACKEND_ENV: nvml_backend.NAME}
        library = _load_library()
        if library is None:
            env[state.ENV_STANDIN] = "1"
        else:
            os.environ.pop(state.ENV_STANDIN, None)  # restored on exit
            previous = os.environ.get("LD_LIBRARY_PATH")
            env["LD_LIBRARY_PATH"] = str(library.parent) + (f":{previous}" if previous else "")
        os.environ.update(env)
        internals.reset_distributed_nvml()
        yield FakeGPUs(
            path=path,
            uuids=tuple(d.uuid for d in devices),
            names=tuple(labels),
            memory=tuple(totals),
            env=env,
            library=library,
            _flags=flags,
            mig=tuple(migs),
        )
    finally:
        # a child forked inside the block that leaves it (sys.exit in the child) leaves
        # the session to its parent, which goes on using it
        if os.getpid() == entered_by:
            device_memory.session_ended()  # first: a failure below leaves none reported
            for key, value in saved_env.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
            internals.restore_distributed_nvml(saved_nvml)
            if path is not None:
                shutil.rmtree(path, ignore_errors=True)
            with _active_lock:
                _active = False


# ---- the library in this process ----


def _load_library() -> Path | None:
    """Build the fake library and load it here, or return None (stand-in) with a warning."""
    directory = build.library_dir()
    if directory is None:
        warnings.warn(
            "accelsched.testing.fake_gpus: the fake libnvidia-ml.so.1 could not be built "
            "(no working C compiler; the log says why). Using the pure-Python stand-in: "
            "accelsched sees the fake GPUs, pynvml itself (distributed's diagnostics, "
            "dask-cuda) does not. Install a C compiler or set $CC for the full simulation.",
            FakeNVMLWarning,
            stacklevel=4,
        )
        return None
    library = directory / build.SONAME
    _warn_if_real_nvml_loaded()
    if not any(lib._name == str(library) for lib in _loaded):
        _loaded.append(ctypes.CDLL(str(library)))
    return library


def _warn_if_real_nvml_loaded() -> None:
    """A library loaded in a process cannot be swapped: say so instead of lying quietly."""
    real = None
    pynvml = sys.modules.get("pynvml")
    lib = getattr(pynvml, "nvmlLib", None)
    if lib is not None and not hasattr(lib, "accelsched_fake_nvml"):
        real = "pynvml already loaded the real NVML"
    else:
        try:
            maps = Path("/proc/self/maps").read_text()
        except OSError:
            maps = ""
        for line in maps.splitlines():
            mapped = line.split(maxsplit=5)[-1]
            if "libnvidia-ml.so" in mapped and "/fakenvml-" not in mapped:
                real = f"the real NVML ({mapped}) is already loaded"
                break
    if real:
        warnings.warn(
            f"accelsched.testing.fake_gpus: {real} in this process, so this process keeps "
            "seeing the real GPUs; processes started inside fake_gpus() see the fake ones. "
            "Enter fake_gpus() before anything imports and initializes NVML.",
            FakeNVMLWarning,
            stacklevel=5,
        )
