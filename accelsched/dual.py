"""``dual(gpu_fn, cpu_fn)``: one task, two implementations.

The scheduler decides at placement time whether a GPU task runs on a GPU or falls back
to a CPU worker; the task's function decides nothing. ``dual`` makes that choice inside
the task from the lease it holds: the GPU form under a GPU lease, the CPU form otherwise.

When the GPU form runs out of device memory (an exception named in the guard's
``oom_exceptions``, CuPy's ``OutOfMemoryError`` by default), the task is retried once in
its CPU form, in the same thread, and a ``fallback`` event with reason ``oom`` is sent.
Exceptions are matched by name, so CuPy is never imported to check them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

from accelsched.context import current_lease, released

__all__ = ["dual", "Dual"]

R = TypeVar("R")


class Dual(Generic[R]):
    """A picklable callable running ``gpu_fn`` under a GPU lease and ``cpu_fn`` otherwise."""

    __slots__ = ("gpu_fn", "cpu_fn")

    def __init__(self, gpu_fn: Callable[..., R], cpu_fn: Callable[..., R]) -> None:
        for name, fn in (("gpu_fn", gpu_fn), ("cpu_fn", cpu_fn)):
            if not callable(fn):
                raise TypeError(f"dual() {name} must be callable, got {fn!r}")
        self.gpu_fn = gpu_fn
        self.cpu_fn = cpu_fn

    def __call__(self, *args: Any, **kwargs: Any) -> R:
        lease = current_lease()
        if lease is None:
            return self.cpu_fn(*args, **kwargs)
        try:
            return self.gpu_fn(*args, **kwargs)
        except Exception as exc:
            if not _named(exc, lease.oom_exceptions):
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

    def __reduce__(self) -> tuple[Any, ...]:
        return (Dual, (self.gpu_fn, self.cpu_fn))

    def __repr__(self) -> str:
        return f"dual({_name(self.gpu_fn)}, {_name(self.cpu_fn)})"

    @property
    def __name__(self) -> str:  # dask derives task-name prefixes from this
        return _name(self.gpu_fn)


def _named(exc: BaseException, names: tuple[str, ...]) -> bool:
    return any(f"{c.__module__}.{c.__qualname__}" in names for c in type(exc).__mro__)


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def dual(gpu_fn: Callable[..., R], cpu_fn: Callable[..., R]) -> Dual[R]:
    """Return a callable that runs ``gpu_fn`` on a GPU and ``cpu_fn`` when it fell back."""
    return Dual(gpu_fn, cpu_fn)
