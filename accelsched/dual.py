"""``dual(gpu_fn, cpu_fn)`` and ``@gpu``: GPU steps marked in code.

``dual(gpu_fn, cpu_fn)``: one task, two implementations.

The scheduler decides at placement time whether a GPU task runs on a GPU or falls back
to a CPU worker; the task's function decides nothing. ``dual`` makes that choice inside
the task from the lease it holds: the GPU form under a GPU lease, the CPU form otherwise.

When the GPU form runs out of device memory (an exception named in the guard's
``oom_exceptions``, CuPy's ``OutOfMemoryError`` by default), the task is retried once in
its CPU form, in the same thread, and a ``fallback`` event with reason ``oom`` is sent.
Exceptions are matched by name, so CuPy is never imported to check them; a library
whose allocator raises its own type registers it
(:func:`accelsched.context.register_oom_exception`), as the simulated devices do.

``@gpu`` (or ``@gpu(count=2, fallback_timeout="5s")``) marks a GPU-only step. Both carry
a :class:`~accelsched.policy.marks.Mark`: any task that calls one, wherever it sits in the graph,
is a GPU task, with no ``dask.annotate`` (see :mod:`accelsched.policy.marks`).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any, Generic, TypeVar, overload

from accelsched.context import current_lease, out_of_memory, released
from accelsched.policy.marks import Mark, note_marked
from accelsched.policy.requirements import parse_requirement
from accelsched.policy.timeouts import DUAL_TIMEOUT, invalid_amount, parse_task_timeout
from accelsched.shipping import Unloadable, importable, ship, unpickle

__all__ = ["dual", "Dual", "gpu", "GPUStep"]

#: A dual step needs one GPU and falls back after the plugin's default timeout, else
#: after :data:`~accelsched.policy.timeouts.DUAL_TIMEOUT`.
_DUAL_MARK = Mark(count=1, cpu_form=DUAL_TIMEOUT)

R = TypeVar("R")

_UNSET: Any = object()  # an argument not given (None is a value: strict)


class Dual(Generic[R]):
    """A picklable callable running ``gpu_fn`` under a GPU lease and ``cpu_fn`` otherwise."""

    __slots__ = ("gpu_fn", "cpu_fn", "shipped", "__accelsched_gpu__")

    def __init__(
        self, gpu_fn: Callable[..., R], cpu_fn: Callable[..., R], mark: Mark = _DUAL_MARK
    ) -> None:
        for name, fn in (("gpu_fn", gpu_fn), ("cpu_fn", cpu_fn)):
            if not callable(fn):
                raise TypeError(f"dual() {name} must be callable, got {fn!r}")
        self.gpu_fn = gpu_fn
        self.cpu_fn = cpu_fn
        self.shipped: bytes | None = None
        self.__accelsched_gpu__ = mark
        note_marked()

    def __call__(self, *args: Any, **kwargs: Any) -> R:
        lease = current_lease()
        if lease is None:
            return self.cpu_fn(*args, **kwargs)
        try:
            return lease.run_step(_name(self.gpu_fn), lambda: self.gpu_fn(*args, **kwargs))
        except Exception as exc:
            if not out_of_memory(exc, lease.oom_exceptions):
                raise
            if lease.report is not None:
                lease.report(
                    "fallback",
                    key=lease.key,
                    waited=0.0,
                    reason="oom",
                    error=f"{type(exc).__name__}: {exc}",
                )
        with released():  # the CPU form sees no GPU: array_module() is numpy
            return self.cpu_fn(*args, **kwargs)

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        """As a method: bound to its instance, and still marked."""
        return self if obj is None else Bound(self, obj)

    def __reduce__(self) -> tuple[Any, ...]:
        # both functions travel as cloudpickle ships them (by value from __main__), in
        # bytes of their own: a process that cannot load them still reads the mark
        shipped = ship(self, (self.gpu_fn, self.cpu_fn))
        mark = self.__accelsched_gpu__
        if shipped is None:
            return (Dual, (self.gpu_fn, self.cpu_fn, mark))
        gpu_fn = self.gpu_fn
        label = gpu_fn.label if isinstance(gpu_fn, Unloadable) else repr(self)
        return (_load_dual, (label, shipped, mark))

    def __repr__(self) -> str:
        if isinstance(self.gpu_fn, Unloadable):
            return repr(self.gpu_fn)
        return f"dual({_name(self.gpu_fn)}, {_name(self.cpu_fn)})"

    @property
    def __name__(self) -> str:  # dask derives task-name prefixes from this
        return _name(self.gpu_fn)


class Bound:
    """A marked step bound to an instance (``model.predict``): marked as the step is, and
    the instance is ``self``, not an argument the walk should take for a call (a model
    whose own ``__call__`` is a marked step of another count would count otherwise)."""

    __slots__ = ("step", "obj")

    def __init__(self, step: Any, obj: Any) -> None:
        self.step = step
        self.obj = obj

    @property
    def __accelsched_gpu__(self) -> Mark:
        return self.step.__accelsched_gpu__  # type: ignore[no-any-return]

    @property
    def __name__(self) -> str:  # dask derives task-name prefixes from this
        return str(self.step.__name__)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.step(self.obj, *args, **kwargs)

    def __reduce__(self) -> tuple[Any, ...]:
        return (Bound, (self.step, self.obj))

    def __repr__(self) -> str:
        return f"<bound {self.step!r} of {type(self.obj).__name__}>"


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def dual(
    gpu_fn: Callable[..., R],
    cpu_fn: Callable[..., R],
    *,
    fallback_timeout: Any = _UNSET,
    memory: Any = None,
    model: str | None = None,
    capability: Any = None,
    mig: bool | None = None,
) -> Dual[R]:
    """Return a callable that runs ``gpu_fn`` on a GPU and ``cpu_fn`` when it fell back.

    ``fallback_timeout``: how long its tasks wait unplaced before ``cpu_fn`` runs, as
    ``gpu(fallback_timeout=...)`` takes it; None keeps them strict. Not given: the
    plugin's ``fallback_timeout``, else :data:`~accelsched.policy.timeouts.DUAL_TIMEOUT`
    (30 s). ``memory``, ``model``, ``capability``, ``mig``: what its device must be
    (:mod:`accelsched.policy.requirements`; docs/placement.md). A bad value raises here.
    """
    mark = _mark("dual", 1, fallback_timeout, DUAL_TIMEOUT, memory, model, capability, mig)
    return Dual(gpu_fn, cpu_fn, mark)


def _mark(
    who: str, count: Any, fallback_timeout: Any, cpu_form: float | None, *device: Any
) -> Mark:
    """A step's mark from ``who``'s arguments (``device``: memory, model, capability,
    mig); a bad one raises naming ``who`` and the value."""
    if invalid_amount(count) is not None:
        raise ValueError(f"{who}(): invalid count={count!r}: expected a positive number of GPUs")
    given = fallback_timeout is not _UNSET
    try:
        timeout = parse_task_timeout(fallback_timeout) if given else None
        requirement = parse_requirement(dict(zip(_DEVICE, device, strict=True)))
    except ValueError as exc:
        raise ValueError(f"{who}(): {exc}") from None
    return Mark(
        count=count,
        timeout=timeout,
        timeout_given=given,
        cpu_form=cpu_form,
        requirement=requirement or None,
    )


_DEVICE = ("memory", "model", "capability", "mig")


class GPUStep(Generic[R]):
    """A picklable GPU-only step: ``fn`` itself, marked as needing ``count`` GPUs.

    Placed on a GPU like a ``dual`` step. Without a ``fallback_timeout`` it waits for a
    GPU as long as it takes (unless the plugin's default says otherwise); with one, it
    runs on the host after that long unplaced, where ``array_module()`` is numpy.
    """

    __slots__ = ("fn", "__accelsched_gpu__", "__dict__")

    def __init__(self, fn: Callable[..., R], mark: Mark) -> None:
        if not callable(fn):
            raise TypeError(f"gpu() needs a callable, got {fn!r}")
        self.fn = fn
        self.__accelsched_gpu__ = mark
        note_marked()
        functools.update_wrapper(self, fn)  # type: ignore[arg-type]
        self.shipped: bytes | None = None  # the bytes it was loaded from, if any

    def __call__(self, *args: Any, **kwargs: Any) -> R:
        lease = current_lease()
        if lease is None:
            return self.fn(*args, **kwargs)
        return lease.run_step(_name(self.fn), lambda: self.fn(*args, **kwargs))

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        """As a method: bound to its instance, and still marked."""
        return self if obj is None else Bound(self, obj)

    def __reduce__(self) -> tuple[Any, ...]:
        mark = self.__accelsched_gpu__
        if isinstance(self.fn, Unloadable):  # passing through: the next process tries again
            return self.fn.reduce_with(mark)
        # ``@gpu`` on an importable module-level function puts this object where the
        # function was: by reference, as cloudpickle would ship the function itself
        where = importable(self)
        if where is not None:
            return (_load_step_by_name, (*where, mark))
        shipped = ship(self, self.fn)  # by value: __main__, nested, lambdas, ...
        if shipped is None:
            return (GPUStep, (self.fn, mark))
        return (_load_step, (_name(self.fn), shipped, mark))

    def __repr__(self) -> str:
        return f"gpu({_name(self.fn)}, count={self.__accelsched_gpu__.count:g})"


# --- loaders: how the steps above come back in another process (accelsched.shipping) -----


def _load_step(label: str, payload: bytes, mark: Mark) -> GPUStep[Any]:
    """A ``@gpu`` step shipped by value; unloadable here, still marked."""
    fn, error = unpickle(label, payload)
    if error is not None:
        fn = Unloadable(repr(label), error, (_load_step, (label, payload)))
    step: GPUStep[Any] = GPUStep(fn, mark)
    step.shipped = payload  # passing through the scheduler: the same bytes go on
    return step


def _load_step_by_name(module: str, qualname: str, mark: Mark) -> Any:
    """A ``@gpu`` step shipped by reference; unloadable here, still marked."""
    label = f"{module}.{qualname}"
    try:
        target: Any = importlib.import_module(module)
        for part in qualname.split("."):
            target = getattr(target, part)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
        return GPUStep(
            Unloadable(repr(label), error, (_load_step_by_name, (module, qualname))), mark
        )
    return target if isinstance(target, GPUStep) else GPUStep(target, mark)


def _load_dual(label: str, payload: bytes, mark: Mark = _DUAL_MARK) -> Dual[Any]:
    """A ``dual`` step; unloadable here, still marked (calling it raises, naming it)."""
    fns, error = unpickle(label, payload)
    if error is not None:
        missing = Unloadable(label, error, (_load_dual, (label, payload, mark)))
        fns = (missing, missing)
    step: Dual[Any] = Dual(fns[0], fns[1], mark)
    step.shipped = payload
    return step


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
) -> Any:
    """Mark a GPU step: ``@gpu`` or ``@gpu(count=1, fallback_timeout="5s")``.

    Any task that calls the step, wherever dask puts it, is placed on verified GPUs and
    bound to its own device(s), with no ``dask.annotate``. ``memory="24GiB"``,
    ``model="*H100*"``, ``capability="8.0"``, ``mig=True/False``: what each of its
    devices must be (docs/placement.md). Bad arguments raise here, naming the value.
    """
    mark = _mark("gpu", count, fallback_timeout, None, memory, model, capability, mig)
    if fn is not None:
        return GPUStep(fn, mark)
    return lambda f: GPUStep(f, mark)
