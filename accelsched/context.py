"""What a running task knows about the device it holds, and the GPU steps marked in
code that choose by it (``dual`` and ``@gpu``).

CUDA's current device is per thread, and a worker runs several tasks at once in its
thread pool, so the device a task holds is kept in a thread-local set by the guard just
before the task's function runs (see :mod:`accelsched.policy.requirements`) and cleared after it.

**Marked steps**, ``dual(gpu_fn, cpu_fn)`` and ``@gpu``: GPU steps marked in code.

``dual(gpu_fn, cpu_fn)``: one task, two implementations.

The scheduler decides at placement time whether a GPU task runs on a GPU or falls back
to a CPU worker; the task's function decides nothing. ``dual`` makes that choice inside
the task from the lease it holds: the GPU form under a GPU lease, the CPU form otherwise.

When the GPU form runs out of device memory (an exception named in the guard's
``oom_exceptions``, CuPy's ``OutOfMemoryError`` by default), the task is retried once in
its CPU form, in the same thread, and a ``fallback`` event with reason ``oom`` is sent.
Exceptions are matched by name, so CuPy is never imported to check them; a library
whose allocator raises its own type registers it
(:func:`register_oom_exception`), as the simulated devices do.

How a step travels: the scheduler unpickles every task with the graph to find the
marks, and it is usually another process (``dask scheduler``, helm, jobqueue) that cannot
import the client's ``__main__`` nor, often, its libraries. A step therefore travels as
cloudpickle would ship its plain function (by value from ``__main__``, a notebook, a
closure or a lambda; by reference where importable), and its functions are pickled into
bytes of their own: a process that cannot load them still gets the mark, so the task is
placed, and the task alone errs, naming the step, where it runs and still cannot load it.

``@gpu`` (or ``@gpu(count=2, fallback_timeout="5s")``) marks a GPU-only step. Both are a
:class:`GPUStep` carrying a :class:`~accelsched.policy.marks.Mark`: any task that calls
one, wherever it sits in the graph, is a GPU task, with no ``dask.annotate`` (see
:mod:`accelsched.policy.marks`).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
import threading
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Generic, TypeVar, cast, overload

import cloudpickle

from accelsched import devices
from accelsched.devices import Cuda, MemoryCap, cuda
from accelsched.policy.marks import Mark, note_marked
from accelsched.policy.requirements import device_count_problem, invalid_amount, parse_requirement
from accelsched.policy.timeouts import DUAL_TIMEOUT, MAX_GPUS, parse_task_timeout

__all__ = [
    "GPUStep",
    "Lease",
    "Unloadable",
    "array_module",
    "bind",
    "current_device",
    "current_lease",
    "dual",
    "gpu",
    "unbind",
    "using_device",
]


@dataclass(frozen=True)
class Lease:
    """The devices one task holds while it runs.

    ``devices`` are CUDA indices as this process sees them (positions within
    ``CUDA_VISIBLE_DEVICES``).
    """

    key: object
    devices: tuple[int, ...]
    #: ``report(action, **figures)``: sends an accelsched event from the task's worker.
    report: Callable[..., None] | None = None
    #: Dotted names of exceptions meaning "out of device memory" (``oom_exceptions``).
    oom_exceptions: tuple[str, ...] = ()
    #: ``meter(step_name, call)``: runs ``call()`` measuring what that marked step leaves
    #: on the device (the guard's attribution); None where nothing measures.
    meter: Callable[[str, Callable[[], Any]], Any] | None = None
    #: What the task's allocations hold against the memory it declared (None: it
    #: declared none); see :mod:`accelsched.devices`.
    cap: MemoryCap | None = None
    #: The CUDA of the process's NVML backend, resolved once by whoever leases (the
    #: guard, at setup); None: looked up as the lease is bound.
    cuda: Cuda | None = None


def lease_of(
    key: object,
    devices: tuple[int, ...],
    report: Callable[..., None] | None,
    oom_exceptions: tuple[str, ...],
    meter: Callable[[str, Callable[[], Any]], Any] | None,
    cap: MemoryCap | None,
    cuda: Cuda | None,
) -> Lease:
    """``Lease(key, devices, ...)``, the same object, made without the frozen dataclass's
    ``__init__`` (a Python call setting each field through ``object.__setattr__``: a
    microsecond per GPU task, the guard's hot path). Every field is given: nothing a
    default or ``__post_init__`` would add is left out."""
    lease = object.__new__(Lease)
    lease.__dict__.update(
        key=key,
        devices=devices,
        report=report,
        oom_exceptions=oom_exceptions,
        meter=meter,
        cap=cap,
        cuda=cuda,
    )
    return lease


_local = threading.local()


def current_lease() -> Lease | None:
    return getattr(_local, "lease", None)


def current_device() -> int | None:
    """The device index the running task holds; None outside a task holding a GPU."""
    lease = current_lease()
    return None if lease is None else lease.devices[0]


devices.task_device = current_device  # objects on an unknown device count on the task's


def array_module() -> ModuleType:
    """``cupy`` inside a task holding a real GPU, ``numpy`` everywhere else.

    Write a step once against the returned module (``xp = array_module(); xp.sum(...)``)
    and it runs on the device when placed on a GPU and on the host when it fell back.
    The NVML backend's CUDA says which (:mod:`accelsched.devices`): on the
    simulated GPUs of :mod:`accelsched.testing` it is numpy, they run no kernels.
    """
    if current_lease() is not None:
        return cuda().array_module()
    import numpy

    return numpy


def bind(lease: Lease) -> tuple[Lease | None, list[Callable[[], Any]]]:
    """Make ``lease`` current in this thread and, on real GPUs, its device CUDA's current
    one (the guard's per-task path, so no generator); returns what :func:`unbind` needs to
    restore the thread's state."""
    previous = getattr(_local, "lease", None)
    _local.lease = lease
    undo: list[Callable[[], Any]] = []
    try:
        backend = cuda() if lease.cuda is None else lease.cuda
        if (restore := backend.use(lease.devices[0])) is not None:
            undo.append(restore)
        if lease.cap is not None and (uncount := backend.count(lease.cap)) is not None:
            undo.append(uncount)
        return previous, undo
    except BaseException:
        unbind((previous, undo))
        raise


def unbind(bound: tuple[Lease | None, list[Callable[[], Any]]]) -> None:
    previous, undo = bound
    _local.lease = previous
    for step in reversed(undo):
        step()


@contextmanager
def using_device(device: int) -> Iterator[None]:
    """Make ``device`` CUDA's current one in this thread for a moment (as the backend's
    CUDA does: nothing on simulated GPUs)."""
    restore = cuda().use(device)
    try:
        yield
    finally:
        if restore is not None:
            restore()


#: Exception types registered as "out of device memory", beside ``oom_exceptions``.
_OOM_TYPES: set[type[BaseException]] = set()


def register_oom_exception(exc_type: type[BaseException]) -> None:
    """Count ``exc_type`` (and its subclasses) as running out of device memory in every
    ``dual`` task of this process, whatever ``oom_exceptions`` says."""
    if not (isinstance(exc_type, type) and issubclass(exc_type, BaseException)):
        raise TypeError(f"register_oom_exception() takes an exception type, not {exc_type!r}")
    _OOM_TYPES.add(exc_type)


R = TypeVar("R")

_UNSET: Any = object()  # an argument not given (None is a value: strict)


def _unwrapped(f: Any) -> Any:
    while isinstance(f, functools.partial):
        f = f.func
    return f


def _call_of(f: Any) -> Any:
    """What calling ``f`` runs: ``f`` (a partial's function), or its class's ``__call__``."""
    f = _unwrapped(f)
    if inspect.isfunction(f) or inspect.ismethod(f):
        return f
    return inspect.getattr_static(type(f), "__call__", None)


def _async(f: Any) -> bool:
    """An ``async def`` function or generator, a partial of one, or an instance whose
    ``__call__`` is one."""
    call = _call_of(f)
    return inspect.iscoroutinefunction(call) or inspect.isasyncgenfunction(call)


def _check_form(who: str, f: Any) -> None:
    """A step's form must be a plain callable a task's thread can run under its lease."""
    if isinstance(f, staticmethod):  # callable, but bound as a method by the step
        raise TypeError(
            f"{who} got a staticmethod: put @staticmethod above the GPU mark "
            "(@staticmethod, then @accelsched.gpu, then def)"
        )
    if f is not None and not callable(f):
        raise TypeError(f"{who} needs a callable, got {f!r}")
    if f is not None and _async(f):
        # distributed runs a coroutine task on the event loop, never in a thread under a
        # lease: marked, it would return a coroutine nobody awaits
        raise TypeError(
            f"{who} cannot be a coroutine function ({_name(_unwrapped(f))} is async def): it "
            "runs in its task's thread under the device lease; call asyncio.run in a plain "
            "function"
        )
    if f is not None and inspect.isgeneratorfunction(_call_of(f)):
        # its body runs as the generator is iterated, after the step returned and its
        # lease ended: on no device, with numpy for array_module()
        raise TypeError(
            f"{who} cannot be a generator function ({_name(_unwrapped(f))} yields): its "
            "body would run only as the generator is iterated, after the step returned (a "
            "GPU form's outside its lease); return a list (or another value) instead"
        )


class GPUStep(Generic[R]):
    """A picklable marked step: ``fn`` under a GPU lease.

    ``cpu_fn`` is a ``dual`` step's CPU form: it runs outside a GPU lease, and in the
    same thread when ``fn`` ran out of device memory. Without one (``@gpu``) the step is
    GPU-only: placed on a GPU, and ``fn`` itself runs on the host after it fell back,
    where ``array_module()`` is numpy.
    """

    __slots__ = ("fn", "cpu_fn", "shipped", "__accelsched_gpu__", "__dict__")

    def __init__(
        self,
        fn: Callable[..., R],
        mark: Mark,
        cpu_fn: Callable[..., R] | None = None,
        shipped: bytes | None = None,
    ) -> None:
        for who, f in (("a GPU step", fn), ("a GPU step's cpu_fn", cpu_fn)):
            if f is None and who == "a GPU step":
                raise TypeError(f"{who} needs a callable, got None")
            _check_form(who, f)
        self.fn = fn
        self.cpu_fn = cpu_fn
        self.__accelsched_gpu__ = mark
        self.shipped = shipped  # the bytes it was loaded from, if any
        note_marked()
        functools.update_wrapper(self, fn)  # type: ignore[arg-type]
        self.__name__ = _name(fn)  # dask derives task-name prefixes from this

    def __call__(self, *args: Any, **kwargs: Any) -> R:
        lease = current_lease()
        if lease is None:
            return (self.fn if self.cpu_fn is None else self.cpu_fn)(*args, **kwargs)
        try:
            call = functools.partial(self.fn, *args, **kwargs)  # measured when the guard can
            return call() if lease.meter is None else lease.meter(_name(self.fn), call)
        except Exception as exc:
            # "out of device memory": a type named in the guard's ``oom_exceptions`` (by
            # name, so CuPy is never imported to check) or registered
            if self.cpu_fn is None or not any(
                c in _OOM_TYPES or f"{c.__module__}.{c.__qualname__}" in lease.oom_exceptions
                for c in type(exc).__mro__
            ):
                raise
            # (its text only: the error's frames may hold device arrays, freed now)
            oom = f"{type(exc).__name__}: {exc}"
            if lease.report is not None:
                lease.report("fallback", key=lease.key, waited=0.0, reason="oom", error=oom)
        _local.lease = None  # the CPU form sees no GPU: array_module() is numpy
        try:
            return self.cpu_fn(*args, **kwargs)
        except Exception as exc:  # why the CPU form ran, where its error is read
            if exc.__cause__ is not None:  # its own cause is kept
                raise
            why = RuntimeError(
                f"{_name(self.fn)}: the GPU form ran out of device memory ({oom}); the CPU "
                "form ran instead"
            )
            why.__context__ = exc.__context__  # (what it raised while handling, if any)
            raise exc from why
        finally:
            _local.lease = lease

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        """As a method: bound to its instance, and still marked (a bound method reads
        its function's attributes). The walk stops at the mark, so the instance is never
        taken for a call (a model whose own ``__call__`` is another marked step)."""
        return self if obj is None else types.MethodType(self, obj)

    def __reduce__(self) -> tuple[Any, ...]:
        mark = self.__accelsched_gpu__
        if isinstance(self.fn, Unloadable):  # passing through: the next process tries again
            loader, args = self.fn.reload
            return (loader, (*args, mark))
        # ``@gpu`` on an importable module-level function puts this object where the
        # function was: by reference, as cloudpickle would ship the function itself
        if (where := importable(self)) is not None:
            return (_load_step_by_name, (*where, mark))
        # by value (__main__, nested, lambdas, ...), in bytes of their own: a process
        # that cannot load them still reads the mark
        if (shipped := ship(self, (self.fn, self.cpu_fn))) is None:
            return (GPUStep, (self.fn, mark, self.cpu_fn))
        label = repr(_name(self.fn)) if self.cpu_fn is None else repr(self)
        return (_load_step, (label, shipped, mark))

    def __repr__(self) -> str:
        if isinstance(self.fn, Unloadable):
            return repr(self.fn)
        if self.cpu_fn is not None:
            return f"dual({_name(self.fn)}, {_name(self.cpu_fn)})"
        return f"gpu({_name(self.fn)}, count={self.__accelsched_gpu__.count:g})"


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def _mark(
    who: str, count: Any, fallback_timeout: Any, cpu_form: float | None, **device: Any
) -> Mark:
    """A step's mark from ``who``'s arguments (``device``: memory, model, capability,
    mig, enforce); a bad one raises naming ``who`` and the value."""
    if invalid_amount(count) is not None:
        raise ValueError(f"{who}(): invalid count={count!r}: expected a positive number of GPUs")
    if count > MAX_GPUS:  # every task of it would err, or fall back at once
        raise ValueError(
            f"{who}(): invalid count={count!r}: no worker can ever offer more than {MAX_GPUS} GPUs"
        )
    given = fallback_timeout is not _UNSET
    try:
        timeout = parse_task_timeout(fallback_timeout) if given else None
        requirement = parse_requirement(device)
    except ValueError as exc:
        raise ValueError(f"{who}(): {exc}") from None
    if problem := device_count_problem(requirement, count):  # every task of it would err
        raise ValueError(f"{who}(): {problem}")
    return Mark(count, timeout, given, cpu_form, requirement or None)


def dual(
    gpu_fn: Callable[..., R],
    cpu_fn: Callable[..., R],
    *,
    fallback_timeout: Any = _UNSET,
    memory: Any = None,
    model: str | None = None,
    capability: Any = None,
    mig: bool | None = None,
    enforce: bool | None = None,
) -> GPUStep[R]:
    """Return a callable that runs ``gpu_fn`` on a GPU and ``cpu_fn`` when it fell back.

    ``fallback_timeout``: how long its tasks wait unplaced before ``cpu_fn`` runs, as
    ``gpu(fallback_timeout=...)`` takes it; None keeps them strict. Not given: the
    plugin's ``fallback_timeout``, else :data:`~accelsched.policy.timeouts.DUAL_TIMEOUT`
    (30 s). ``memory``, ``model``, ``capability``, ``mig``: what its device must be
    (:mod:`accelsched.policy.requirements`; docs/placement.md); ``enforce``: whether an
    allocation past ``memory`` fails (None: the guard's ``enforce_memory``). A bad value
    raises here.
    """
    if gpu_fn is None:
        raise TypeError("dual() needs a gpu_fn, got None")
    if cpu_fn is None:  # a GPU-only step is @gpu: strict unless told, not the dual's 30 s
        raise TypeError("dual() needs a cpu_fn, got None (a GPU-only step: accelsched.gpu)")
    return GPUStep(
        gpu_fn,
        _mark(
            "dual",
            1,
            fallback_timeout,
            DUAL_TIMEOUT,
            memory=memory,
            model=model,
            capability=capability,
            mig=mig,
            enforce=enforce,
        ),
        cpu_fn,
    )


# --- how a step travels and comes back in another process (see the module docstring) ---


class Unloadable:
    """Stands for a step's function that this process could not load.

    Calling it raises, naming the step and why; its step, pickled again, carries what it was
    loaded from (``reload``: its loader and arguments, the mark left out), so a worker
    that has the step's module loads the real step.
    """

    def __init__(self, label: str, exc: Exception, reload: tuple[Any, ...]) -> None:
        self.label = label
        self.error = f"{type(exc).__name__}: {exc}"
        self.reload = reload
        self.__name__ = self.__qualname__ = label

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"accelsched step {self.label} could not be loaded in this process: "
            f"{self.error}. Install the modules it needs where it runs (a scheduler needs "
            "none of them: it only reads the step's mark)"
        )

    def __repr__(self) -> str:
        return f"<unloadable accelsched step {self.label}>"


def importable(obj: Any) -> tuple[str, str] | None:
    """``(module, qualname)`` where cloudpickle would ship a function of ``obj``'s name
    by reference: its module is a real, imported one, not ``__main__``, not registered to
    travel by value, and the name leads back to ``obj``. None: ship it by value."""
    module_name = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    if (
        not isinstance(module_name, str)
        or not isinstance(qualname, str)
        or module_name == "__main__"
        or "<" in qualname  # <locals>, <lambda>
        or (module := sys.modules.get(module_name)) is None
        or getattr(module, "__spec__", None) is None  # dynamic
        # registered by value: the module or a package above it
        or any(
            module_name == m or module_name.startswith(f"{m}.")
            for m in cloudpickle.list_registry_pickle_by_value()
        )
    ):
        return None
    target: Any = functools.reduce(
        lambda o, k: getattr(o, k, None), qualname.split("."), cast(Any, module)
    )
    return (module_name, qualname) if target is obj else None


_shipping = threading.local()


def ship(step: GPUStep[Any], functions: Any) -> bytes | None:
    """``functions`` pickled apart, or None while ``step`` is being shipped already: a
    recursive step reaches itself through its own globals, and only the enclosing
    pickler's memo can close that cycle.

    A step loaded from bytes sends the same bytes on (the scheduler passes steps
    through); one made here is pickled anew each time, as a plain function is, so a
    notebook's changed globals travel with it.
    """
    if step.shipped is not None:
        return step.shipped
    busy: set[int] = _shipping.__dict__.setdefault("busy", set())
    if id(step) in busy:
        return None
    busy.add(id(step))
    try:
        return cloudpickle.dumps(functions, protocol=5)
    finally:
        busy.discard(id(step))


def _load_step(label: str, payload: bytes, mark: Mark) -> GPUStep[Any]:
    """A step shipped by value; unloadable here, still marked (calling it raises,
    naming it)."""
    try:
        fns = cloudpickle.loads(payload)
    except Exception as exc:  # ModuleNotFoundError, AttributeError, anything it raised
        fns = (Unloadable(label, exc, (_load_step, (label, payload))),) * 2  # both forms
    # passing through the scheduler: the same bytes go on
    return GPUStep(fns[0], mark, fns[1], shipped=payload)


def _load_step_by_name(module: str, qualname: str, mark: Mark) -> Any:
    """A ``@gpu`` step shipped by reference; unloadable here, still marked."""
    try:  # (per task: cheaper than pkgutil's)
        target: Any = functools.reduce(
            getattr, qualname.split("."), importlib.import_module(module)
        )
    except Exception as exc:
        reload = (_load_step_by_name, (module, qualname))
        return GPUStep(Unloadable(repr(f"{module}.{qualname}"), exc, reload), mark)
    return target if isinstance(target, GPUStep) else GPUStep(target, mark)


@overload
def gpu(fn: Callable[..., R], /) -> GPUStep[R]: ...


@overload
def gpu(
    *,
    count: float = 1,
    fallback_timeout: Any = ...,
    memory: Any = None,
    model: str | None = None,
    capability: Any = None,
    mig: bool | None = None,
    enforce: bool | None = None,
) -> Callable[[Callable[..., R]], GPUStep[R]]: ...


def gpu(
    fn: Callable[..., R] | None = None,
    /,
    *,
    count: float = 1,
    fallback_timeout: Any = _UNSET,
    memory: Any = None,
    model: str | None = None,
    capability: Any = None,
    mig: bool | None = None,
    enforce: bool | None = None,
) -> Any:
    """Mark a GPU step: ``@gpu`` or ``@gpu(count=1, fallback_timeout="5s")``.

    Any task that calls the step, wherever dask puts it, is placed on verified GPUs and
    bound to its own device(s), with no ``dask.annotate``. ``memory="24GiB"``,
    ``model="*H100*"``, ``capability="8.0"``, ``mig=True/False``: what each of its
    devices must be (docs/placement.md); ``enforce=True``: an allocation past ``memory``
    fails (None: the guard's ``enforce_memory`` says). Bad arguments raise here, naming
    the value.
    """
    mark = _mark(
        "gpu",
        count,
        fallback_timeout,
        None,
        memory=memory,
        model=model,
        capability=capability,
        mig=mig,
        enforce=enforce,
    )
    return GPUStep(fn, mark) if fn is not None else lambda f: GPUStep(f, mark)
