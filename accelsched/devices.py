"""This process's devices: what NVML says of them, and the device memory the process
uses there (the CUDA it runs, the pools that cache it, the cap on what one task takes,
what each result keeps alive).

**The monitor seam** (:class:`NVMLMonitor`): what NVML says about this process's devices.
Every NVML question accelsched asks goes through :class:`NVMLMonitor`: the inventory a
worker reports, the device memory its leak check reads, the context check for tasks that
did not ask for a GPU. Nothing else imports ``pynvml``.

No driver, no ``libnvidia-ml.so.1`` or no ``pynvml`` means zero GPUs: one log line, never
an exception. MIG devices are found under their parent GPU (NVML does not count them)
and stand for it as CUDA does (:func:`resolve_devices`): a
worker's device is then the MIG device, with its own UUID, memory and processes.

The NVML library is passed in by name (the backend, below).

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

**The backend** (:func:`load_backend`, :func:`cuda`): which NVML library accelsched
reads, and what CUDA its devices run, passed in by name. A backend is a module with
pynvml's functions (``pynvml`` by default, what NVIDIA's ``nvidia-ml-py`` installs), or
one whose ``api()`` returns them. Its ``CUDA`` (a :class:`Cuda`) says how a task's device
is made current and which array module a task computes with there; a backend without one
has CuPy's. So the simulated GPUs of :mod:`accelsched.testing` bring their own (no CUDA
call, numpy), and nothing else in accelsched asks whether devices are simulated. The
environment variable ``ACCELSCHED_NVML_BACKEND`` names the backend, else dask config
``accelsched.nvml-backend``. The environment wins because it is what a process tree was
started with: every process started inside :func:`accelsched.testing.fake_gpus` (or
``accelsched simulate``) inherits the session's backend, whatever config a harness or a
nanny hands its workers (distributed's test clusters restore a config snapshot; a nanny
passes its own config down). Production code names no test module.

**The cap** (:class:`MemoryCap`): what one task holds of the device memory it declared,
counted at each allocation. Packing (:func:`accelsched.policy.requirements.pack`) puts
tasks on a device while their *declared* needs fit; a task that takes more than it
declared takes it from its neighbours, which then run out of memory through no fault of
theirs. The guard gives each task that declared memory a :class:`MemoryCap`, and the
task's allocations count against it: on real GPUs through a CuPy allocator set for the
task's thread alone (``cupy.cuda.using_allocator`` is thread-local, and each task runs in
its own thread of the worker's pool), on the simulated GPUs of :mod:`accelsched.testing`
in ``device_alloc``. With ``enforce`` (``enforce_memory=True``, or
``gpu(memory=..., enforce=True)``) the allocation that would pass the declaration fails
with :class:`DeclaredMemoryExceeded` before it takes anything, so the neighbours are
untouched; without, the peak is measured and reported (``over-declared``). Only
allocations made through CuPy's allocator are seen: memory a library takes directly from
CUDA or from an RMM pool of its own (cuDF does, under ``rmm_cupy_allocator`` too, for
everything but CuPy arrays) is neither capped nor counted (docs/placement.md).

**The pool seam** (:class:`DevicePool`): allocators that cache device memory inside a
worker process. CUDA libraries keep freed device memory in pools so the next allocation
is cheap. NVML cannot tell cached memory from memory in use, so the guard asks the pools
two things: how much of what NVML sees they legitimately hold, and to give back what they
can. Two kinds of pool exist here: CuPy's default device pool plus its pinned host pool
(:class:`CupyPool`, RMM-aware), and the simulated pool of :mod:`accelsched.testing`.
Pools register themselves in :data:`POOLS`; nothing in this module imports CuPy unless
CuPy is already imported by the process (freeing a pool must never create one).

**Footprints** (:data:`device_nbytes`): how many device bytes a Python object keeps
alive, and on which device. The leak estimate subtracts device memory held by results
still in a worker's memory. A result's device footprint is asked once, when it enters or
leaves the worker's data, through this dispatch: CuPy arrays are known, the simulated
buffers of :mod:`accelsched.testing` register themselves, and users can register their
own types (``device_nbytes.register(MyType)(fn)``) returning ``{device: nbytes}``.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import itertools
import logging
import math
import os
import sys
import threading
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol, runtime_checkable

from dask.utils import Dispatch, format_bytes

from accelsched.protocol import DeviceRecord

__all__ = [
    "BACKEND_ENV",
    "BACKEND_KEY",
    "Cuda",
    "CupyPool",
    "DeclaredMemoryExceeded",
    "DeviceInfo",
    "DevicePool",
    "GPU_LIBRARIES",
    "MemoryCap",
    "MemoryReading",
    "NVMLMonitor",
    "POOLS",
    "PoolStats",
    "Visible",
    "active_pools",
    "backend_module",
    "counted_allocator",
    "cuda",
    "device_nbytes",
    "knows",
    "load_backend",
    "register_pool",
    "resolve_devices",
    "to_host",
    "visible_from_env",
]

logger = logging.getLogger(__name__)


#: The config key naming the NVML backend module.
BACKEND_KEY = "accelsched.nvml-backend"
#: The environment variable naming it, before the config.
BACKEND_ENV = "ACCELSCHED_NVML_BACKEND"


def backend_module() -> ModuleType:
    """This process's backend module (the environment's, else the config's).
    ``ImportError`` when it is not installed, ``ValueError`` naming a value that is no
    module name."""
    name, where = os.environ.get(BACKEND_ENV), BACKEND_ENV
    if not name:
        from accelsched.config import config_value

        name, where = config_value(BACKEND_KEY), f"dask config {BACKEND_KEY}"
    # asked as each GPU task starts (:func:`cuda`): one imported is looked up, not imported
    if (
        isinstance(name, str)
        and (module := sys.modules.get(name)) is not None
        and not getattr(module.__spec__, "_initializing", False)  # another thread imports it
    ):
        return module
    if not isinstance(name, str) or not all(p.isidentifier() for p in name.split(".")):
        raise ValueError(f"{where}: {name!r} is no module name")  # (".pynvml": relative)
    return importlib.import_module(name)


def load_backend() -> Any:
    """The NVML API of this process's backend (see :func:`backend_module`)."""
    module = backend_module()
    api = getattr(module, "api", None)
    return api() if callable(api) else module


class Cuda:
    """CUDA as a task sees it on the GPUs of a backend: real ones, through CuPy."""

    def use(self, device: int) -> Callable[[], Any] | None:
        """Make ``device`` CUDA's current one in this thread; a callable restoring the
        one before (None: nothing to restore, as where CuPy is not installed)."""
        try:
            import cupy
        except ImportError:
            return None
        runtime = cupy.cuda.runtime
        before = runtime.getDevice()
        runtime.setDevice(device)
        return lambda: runtime.setDevice(before)

    def count(self, cap: MemoryCap) -> Callable[[], Any] | None:
        """Count this thread's allocations against ``cap`` (refusing those past it under
        ``enforce``) until the callable returned is called; None: nothing to undo, as
        where CuPy is not installed. CuPy's allocator is set for this thread alone."""
        try:
            import cupy
        except ImportError:
            return None
        scope = cupy.cuda.using_allocator(counted_allocator(cap, cupy.cuda.get_allocator()))
        scope.__enter__()
        return lambda: scope.__exit__(None, None, None)

    def array_module(self) -> ModuleType:
        """The module a task holding one of these devices computes with."""
        import cupy

        return cupy


_REAL = Cuda()


def cuda() -> Cuda:
    """The ``CUDA`` of this process's backend. A backend that cannot be loaded shows no
    GPU (the monitor says why), so no task holds one: CuPy's, never asked."""
    try:
        return getattr(backend_module(), "CUDA", _REAL)  # type: ignore[no-any-return]
    except (ImportError, ValueError):
        return _REAL


class DeclaredMemoryExceeded(MemoryError):
    """A task tried to hold more device memory than it declared, under ``enforce``.

    A ``MemoryError`` (an allocation refused), but not one of the ``oom_exceptions``:
    a ``dual`` task does not retry on the CPU, since the declaration, not the device,
    is wrong.
    """

    def __init__(self, key: str, declared: int, held: int, attempted: int) -> None:
        self.key, self.declared, self.held, self.attempted = key, declared, held, attempted
        super().__init__(
            f"task {key!r} declared {format_bytes(declared)} of device memory "
            f"({declared} bytes) and tried to allocate {format_bytes(attempted)} "
            f"({attempted} bytes) while holding {format_bytes(held)}: declare what it "
            "needs (gpu(memory=...))"
        )

    def __reduce__(self) -> tuple[type, tuple[str, int, int, int]]:
        # the error travels to the client: rebuilt from its figures, not its message
        return type(self), (self.key, self.declared, self.held, self.attempted)


class MemoryCap:
    """The device memory one task's allocations hold now and at most, against what it
    declared; ``enforce``: an allocation past the declaration is refused.

    Allocations end on whichever thread drops the last reference (a result freed
    later, the garbage collector), so the figures are kept under a lock.
    """

    def __init__(self, key: str, declared: int, *, enforce: bool) -> None:
        if declared <= 0:
            raise ValueError(f"a memory cap needs declared bytes > 0, got {declared!r}")
        self.key, self.declared, self.enforce = key, declared, enforce
        self.held = self.peak = 0  # bytes held now, and at most
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> None:
        """Count an allocation of ``nbytes`` about to be made; under ``enforce``, raise
        :class:`DeclaredMemoryExceeded` instead when it would pass the declaration."""
        with self._lock:
            held = self.held + nbytes
            if self.enforce and held > self.declared:
                raise DeclaredMemoryExceeded(self.key, self.declared, self.held, nbytes)
            self.held = held
            self.peak = max(self.peak, held)

    def give(self, nbytes: int) -> None:
        """An allocation counted by :meth:`take` ended (or was never made)."""
        with self._lock:
            self.held -= nbytes

    @property
    def over(self) -> bool:
        """Whether the task held more at some moment than it declared."""
        return self.peak > self.declared


def counted_allocator(cap: MemoryCap, inner: Callable[[int], Any]) -> Callable[[int], Any]:
    """A CuPy allocator that takes its blocks from ``inner`` (the allocator in effect:
    CuPy's pool, or RMM's) and counts them against ``cap`` while they live.

    A block is handed out wrapped (``UnownedMemory`` keeps an owner alive for as long as
    any array uses the memory), and the owner gives the bytes back to ``cap`` as it goes
    and the block back to ``inner``'s pool: CuPy's ``MemoryPointer`` itself takes no
    finalizer.
    """
    from cupy.cuda.memory import MemoryPointer, UnownedMemory

    def malloc(size: int) -> Any:
        cap.take(size)
        try:
            block = inner(size)
        except BaseException:
            cap.give(size)
            raise
        owner = _Counted(block, cap, size)  # gives the bytes back as the last array goes
        return MemoryPointer(UnownedMemory(block.ptr, size, owner, block.device_id), 0)

    return malloc


class _Counted:
    """A block of ``inner``'s, held for as long as arrays use it; gives its bytes back."""

    __slots__ = ("block", "cap", "size")

    def __init__(self, block: Any, cap: MemoryCap, size: int) -> None:
        self.block, self.cap, self.size = block, cap, size

    def __del__(self) -> None:
        self.cap.give(self.size)


@dataclass(frozen=True)
class PoolStats:
    """What one pool holds on one device, in bytes.

    ``held`` is everything the pool has taken from the driver (in use + cached + a fixed
    reservation). ``cached`` is the part that :meth:`DevicePool.free_all` could return.
    ``fixed`` is a reservation that cannot shrink (an RMM pool): retained, never a leak.
    ``fixed_free`` is the unused part of that reservation, None when the pool cannot say
    (RMM without a statistics adaptor).
    """

    held: int = 0
    cached: int = 0
    fixed: int = 0
    fixed_free: int | None = 0

    def __add__(self, other: PoolStats) -> PoolStats:
        free = (
            None
            if self.fixed_free is None or other.fixed_free is None
            else self.fixed_free + other.fixed_free
        )
        return PoolStats(
            self.held + other.held, self.cached + other.cached, self.fixed + other.fixed, free
        )


@runtime_checkable
class DevicePool(Protocol):
    """An allocator that caches device memory in this process."""

    def active(self) -> bool:
        """True when the pool exists in this process (never creates it)."""

    def free_all(self) -> object:
        """Release cached blocks to the driver (what that gave back is measured through
        NVML, not taken from the pool's word: anything returned is ignored)."""

    def stats(self, device: int) -> PoolStats:
        """What the pool holds on ``device`` (a CUDA index of this process)."""


class CupyPool:
    """CuPy's default device pool and pinned pool, left alone when RMM owns allocation.

    Active only when ``cupy`` is already in ``sys.modules`` (:func:`active_pools` asks
    nothing else of an inactive pool): the guard must never import CuPy (and create a
    CUDA context) just to free a pool nobody used.
    """

    def active(self) -> bool:
        return "cupy" in sys.modules

    def uses_rmm(self) -> bool:
        """True when CuPy (imported) allocates through RMM (``rmm_cupy_allocator``)."""
        allocator = sys.modules["cupy"].cuda.get_allocator()
        owner = getattr(allocator, "__module__", "") or ""
        qual = getattr(allocator, "__qualname__", "") or repr(allocator)
        return owner.startswith("rmm") or "rmm" in qual

    def free_all(self) -> None:
        cp = sys.modules["cupy"]
        # cupy imported on a machine without a usable device: nothing to free
        with contextlib.suppress(RuntimeError):
            if not self.uses_rmm():
                cp.get_default_memory_pool().free_all_blocks()
            cp.get_default_pinned_memory_pool().free_all_blocks()

    def stats(self, device: int) -> PoolStats:
        cp = sys.modules["cupy"]
        try:
            if self.uses_rmm():  # reserved up front, it cannot shrink: all of it is fixed
                try:
                    resource = sys.modules["rmm.mr"].get_per_device_resource(device)
                    size = getattr(resource, "pool_size", None)
                    reserved = int(size() if callable(size) else (size or 0))
                except Exception:  # no rmm.mr imported, or a resource that cannot say
                    reserved = 0
                return PoolStats(held=reserved, cached=0, fixed=reserved, fixed_free=None)
            with cp.cuda.Device(device):
                pool = cp.get_default_memory_pool()
                return PoolStats(held=int(pool.total_bytes()), cached=int(pool.free_bytes()))
        except RuntimeError:
            return PoolStats()


POOLS: list[DevicePool] = [CupyPool()]
_lock = threading.Lock()


def register_pool(pool: DevicePool) -> None:
    """Add a pool the guard should free and account for (idempotent by identity)."""
    with _lock:
        if not any(p is pool for p in POOLS):
            POOLS.append(pool)


def active_pools() -> list[DevicePool]:
    return [p for p in POOLS if p.active()]


device_nbytes = Dispatch(name="device_nbytes")

#: Copy a device object to the host (for a task that fell back to a CPU worker).
to_host = Dispatch(name="to_host")


@to_host.register(object)
def _already_host(obj: Any) -> Any:
    return obj


@to_host.register((list, tuple))
def _host_sequence(obj: Any) -> Any:
    items = [to_host(item) for item in obj]
    if all(new is old for new, old in zip(items, obj, strict=True)):
        return obj  # nothing on a device: the very same object
    # a namedtuple takes its fields one by one
    return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)


@to_host.register(dict)
def _host_mapping(obj: dict) -> dict:
    converted = {k: to_host(v) for k, v in obj.items()}
    if all(converted[k] is v for k, v in obj.items()):
        return obj
    out = copy.copy(obj)  # keeps defaultdict's factory, OrderedDict's order, ...
    out.update(converted)
    return out


#: Libraries whose objects hold device memory that dask's ``sizeof`` (their own
#: registrations) measures: a second source where no ``device_nbytes`` rule is registered.
GPU_LIBRARIES = frozenset({"cudf", "dask_cudf", "rmm", "torch", "cupy", "numba", "cuml"})


@device_nbytes.register(object)
def _by_protocol(obj: Any) -> dict[int, int]:
    """Objects with no registered rule: what their protocols or library tell.

    ``__cuda_array_interface__`` (numba, cupy-likes) and ``__dlpack_device__`` name device
    arrays; a type from a GPU library (cudf, rmm, torch, ...) is sized by dask's
    ``sizeof``, which those libraries register. Anything else holds nothing known.
    """
    device = _device_of(obj)
    if device is None:
        return {}
    nbytes = getattr(obj, "nbytes", None)
    if not isinstance(nbytes, int):
        interface: Any = getattr(obj, "__cuda_array_interface__", None)
        try:
            nbytes = math.prod(int(n) for n in interface["shape"]) * int(interface["typestr"][2:])
        except (KeyError, TypeError, ValueError):  # no interface, or not one
            from dask.sizeof import sizeof

            nbytes = int(sizeof(obj))
    return {device: nbytes} if nbytes > 0 else {}


def task_device() -> int | None:
    """The device an object whose device is not known is counted on: the running task's.
    :mod:`accelsched.context`, which keeps it (a layer above this one), replaces this."""
    return None


def _device_of(obj: Any) -> int | None:
    """The CUDA device ``obj`` lives on, or None when it is not known to be on one."""
    dlpack = getattr(obj, "__dlpack_device__", None)
    if callable(dlpack):
        try:
            kind, index = dlpack()
        except Exception:
            return None
        return int(index) if int(kind) in (2, 3, 13) else None  # CUDA, CUDA host, managed
    if not hasattr(obj, "__cuda_array_interface__") and (
        type(obj).__module__.split(".")[0] not in GPU_LIBRARIES
    ):
        return None
    device = getattr(getattr(obj, "device", None), "id", None)
    return device if isinstance(device, int) else task_device() or 0


#: Types known to hold no device memory: a result of one of these is fully accounted.
HOST_TYPES: tuple[type, ...] = (int, float, complex, str, bytes, bool, type(None))


def knows(value: Any) -> bool:
    """Whether ``device_nbytes(value)`` is knowledge rather than a shrug.

    True for registered types, host types (numpy, pandas, Python scalars) and objects a
    protocol describes; False for an object of a type nobody described (a cudf frame
    with no rule, say): its device memory, if any, is measured, and what dask's
    ``sizeof`` says of it (on the device the task held, else device 0) is only a guess.
    """
    if (
        isinstance(value, HOST_TYPES)
        # the protocol tells where it lives and how big it is (host: nothing)
        or hasattr(value, "__cuda_array_interface__")
        or hasattr(value, "__dlpack_device__")
    ):
        return True
    if isinstance(value, (list, tuple, dict)):
        items = value.values() if isinstance(value, dict) else value
        return all(knows(v) for v in itertools.islice(items, SCAN_LIMIT))
    return device_nbytes.dispatch(type(value)) is not _by_protocol or (
        type(value).__module__.split(".")[0] in ("numpy", "pandas", "pyarrow", "scipy")
    )


#: Containers longer than this are scanned only when their first item is on a device:
#: the guard asks at every task's end, on the worker's event loop.
SCAN_LIMIT = 32


@device_nbytes.register((list, tuple, set, frozenset, dict))
def _sequence(obj: Any) -> dict[int, int]:
    items = (
        obj
        if isinstance(obj, (list, tuple))
        else list(obj.values() if isinstance(obj, dict) else obj)
    )
    if len(items) > SCAN_LIMIT and (not items or not device_nbytes(items[0])):
        return {}
    out: Counter[int] = Counter()
    for item in items:
        out.update(device_nbytes(item))
    return dict(out)


def _register_cupy() -> None:
    """CuPy arrays, for both dispatches (whichever meets one first registers both): the
    allocation an array views, whole; its copy on the host."""
    import cupy

    device_nbytes.register(
        cupy.ndarray,
        lambda arr: {
            int(arr.device.id): int((arr if arr.base is None else arr.base).data.mem.size)
        },
    )
    to_host.register(cupy.ndarray, cupy.asnumpy)


device_nbytes.register_lazy("cupy", _register_cupy)
to_host.register_lazy("cupy", _register_cupy)


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

    # --- availability -----------------------------------------------------------------

    def _init(self) -> Any:
        if self._nvml is not None or self.reason is not None:
            return self._nvml
        with _init_lock:
            try:
                nvml = load_backend()
            except ImportError as exc:
                if exc.name == "pynvml":  # the default's: a host without GPUs, as a rule
                    return self._unavailable("pynvml is not installed (pip install nvidia-ml-py)")
                # a backend named by the operator, or one that is broken: said louder
                return self._unavailable(f"the NVML backend cannot be imported: {exc}", True)
            except ValueError as exc:  # a bad accelsched.nvml-backend
                return self._unavailable(str(exc), True)
            try:
                nvml.nvmlInit()
            except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
                return self._unavailable(f"NVML unavailable ({_describe(exc)})")
            self._nvml = nvml
            return nvml

    def _unavailable(self, reason: str, mistake: bool = False) -> None:
        """No NVML here, for ``reason``: said once per process, at INFO where a host
        without GPUs says it (no pynvml, no driver), as a warning where a setting is
        wrong (``mistake``: a backend named that cannot be imported)."""
        self.reason = reason
        if reason not in _logged:
            _logged.add(reason)
            (logger.warning if mistake else logger.info)(
                "accelsched: no GPUs in this process: %s", reason
            )

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
        # a device that does not answer is not ours to use
        devices = [
            _ask(
                None,
                self.query,
                c,
                warn=f"GPU {c} (NVML {f[0]}) does not answer NVML and is left out",
            )
            for c, f in self._found.items()
        ]
        return [d for d in devices if d is not None]

    @property
    def left_out(self) -> list[int]:
        """CUDA indices of the devices visible here that did not answer NVML when they
        were listed (:meth:`devices` leaves them out), until :meth:`adopt` takes one."""
        return sorted(self._found.keys() - {d.index for d in self.devices()})

    def adopt(self, info: DeviceInfo) -> None:
        """A left-out device answers again (see :meth:`query`): list it from now on."""
        self._devices = sorted([*self.devices(), info], key=lambda d: d.index)

    def device(self, index: int) -> DeviceInfo:
        """The listed device with CUDA index ``index`` (``KeyError``: none)."""
        return {d.index: d for d in self.devices()}[index]

    def query(self, index: int) -> DeviceInfo:
        """Device ``index`` (CUDA's) of those found as the devices were listed (a
        left-out one asked again): its description when it answers every query the guard
        makes; raises otherwise. Its handle is kept once it answers."""
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
    count = _ask(
        0, nvml.nvmlDeviceGetMaxMigDeviceCount, handle, warn="MIG devices cannot be listed"
    )
    migs = [
        _ask(None, nvml.nvmlDeviceGetMigDeviceHandleByIndex, handle, i) for i in range(int(count))
    ]
    uuids = [None if m is None else _ask(None, nvml.nvmlDeviceGetUUID, m) for m in migs]
    return {_text(u): m for m, u in zip(migs, uuids, strict=True) if u is not None}


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
        if found.mig_uuid is not None and any(v.mig_uuid is not None for v in out):
            logger.warning(
                "CUDA_VISIBLE_DEVICES entry %r is a second MIG device; a CUDA process "
                "enumerates one MIG device only, so it is left out",
                entry,
            )
            continue
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
    return Visible(index, under[0] if under else None)
