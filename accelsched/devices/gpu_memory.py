"""The device memory a process uses: the CUDA it runs, the pools that cache it, the cap
on what one task takes, and what each result keeps alive.

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

import copy
import importlib
import math
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol, runtime_checkable

from dask.utils import Dispatch, format_bytes

__all__ = [
    "BACKEND_ENV",
    "BACKEND_KEY",
    "Cuda",
    "CupyPool",
    "DeclaredMemoryExceeded",
    "DevicePool",
    "GPU_LIBRARIES",
    "MemoryCap",
    "POOLS",
    "PoolStats",
    "active_pools",
    "backend_module",
    "counted_allocator",
    "cuda",
    "device_nbytes",
    "knows",
    "load_backend",
    "register_pool",
    "to_host",
]


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
    if not isinstance(name, str) or not name.replace(".", "").replace("_", "").isalnum():
        raise ValueError(f"{where}: {name!r} is no module name")
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
        self.key = key
        self.declared = declared
        self.enforce = enforce
        self.held = 0
        self.peak = 0
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
        owner = _Counted(block, cap, size)
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

    name: str

    def active(self) -> bool:
        """True when the pool exists in this process (never creates it)."""

    def free_all(self) -> int:
        """Release cached blocks to the driver; return the bytes released."""

    def stats(self, device: int) -> PoolStats:
        """What the pool holds on ``device`` (a CUDA index of this process)."""


class CupyPool:
    """CuPy's default device pool and pinned pool, left alone when RMM owns allocation.

    Active only when ``cupy`` is already in ``sys.modules`` (:func:`active_pools` asks
    nothing else of an inactive pool): the guard must never import CuPy (and create a
    CUDA context) just to free a pool nobody used.
    """

    name = "cupy"

    def active(self) -> bool:
        return "cupy" in sys.modules

    def uses_rmm(self) -> bool:
        """True when CuPy (imported) allocates through RMM (``rmm_cupy_allocator``)."""
        allocator = sys.modules["cupy"].cuda.get_allocator()
        owner = getattr(allocator, "__module__", "") or ""
        qual = getattr(allocator, "__qualname__", "") or repr(allocator)
        return owner.startswith("rmm") or "rmm" in qual

    def free_all(self) -> int:
        cp = sys.modules["cupy"]
        released = 0
        try:
            if not self.uses_rmm():
                pool = cp.get_default_memory_pool()
                before = pool.total_bytes()
                pool.free_all_blocks()
                released = before - pool.total_bytes()
            cp.get_default_pinned_memory_pool().free_all_blocks()
        except RuntimeError:
            # cupy imported on a machine without a usable device: nothing to free
            return 0
        return max(0, released)

    def stats(self, device: int) -> PoolStats:
        cp = sys.modules["cupy"]
        try:
            if self.uses_rmm():  # reserved up front, it cannot shrink: all of it is fixed
                try:
                    mr = sys.modules["rmm.mr"]
                    size = getattr(mr.get_per_device_resource(device), "pool_size", None)
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


@to_host.register_lazy("cupy")
def _register_cupy_to_host() -> None:
    import cupy

    @to_host.register(cupy.ndarray)
    def _cupy_to_host(arr: Any) -> Any:
        return cupy.asnumpy(arr)


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
            nbytes = None
    if not isinstance(nbytes, int):
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
    on_gpu = hasattr(obj, "__cuda_array_interface__") or (
        type(obj).__module__.split(".")[0] in GPU_LIBRARIES
    )
    if not on_gpu:
        return None
    device = getattr(getattr(obj, "device", None), "id", None)
    if isinstance(device, int):
        return device
    return task_device() or 0


#: Types known to hold no device memory: a result of one of these is fully accounted.
HOST_TYPES: tuple[type, ...] = (int, float, complex, str, bytes, bool, type(None))


def knows(value: Any) -> bool:
    """Whether ``device_nbytes(value)`` is knowledge rather than a shrug.

    True for registered types, host types (numpy, pandas, Python scalars) and objects a
    protocol describes; False for an object of a type nobody described (a cudf frame
    with no rule, say): its device memory, if any, is measured, and what dask's
    ``sizeof`` says of it (on the device the task held, else device 0) is only a guess.
    """
    if isinstance(value, HOST_TYPES):
        return True
    if hasattr(value, "__cuda_array_interface__") or hasattr(value, "__dlpack_device__"):
        return True  # the protocol tells where it lives and how big it is (host: nothing)
    if isinstance(value, (list, tuple)):
        return all(knows(v) for v in value[:SCAN_LIMIT])
    if isinstance(value, dict):
        return all(knows(v) for v in list(value.values())[:SCAN_LIMIT])
    if device_nbytes.dispatch(type(value)) is not _by_protocol:
        return True
    module = type(value).__module__.split(".")[0]
    return module in ("numpy", "pandas", "pyarrow", "scipy")


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
    out: dict[int, int] = {}
    for item in items:
        for dev, n in device_nbytes(item).items():
            out[dev] = out.get(dev, 0) + n
    return out


@device_nbytes.register_lazy("cupy")
def _register_cupy() -> None:
    import cupy

    @device_nbytes.register(cupy.ndarray)
    def _cupy_array(arr: Any) -> dict[int, int]:
        base = arr.base if arr.base is not None else arr
        return {int(arr.device.id): int(base.data.mem.size)}
