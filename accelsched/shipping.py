"""How marked steps travel between processes.

The scheduler unpickles every task with the graph to find the marks, and it is usually
another process (``dask scheduler``, helm, jobqueue) that cannot import the client's
``__main__`` nor, often, its libraries. A step therefore travels as cloudpickle would
ship its plain function (by value from ``__main__``, a notebook, a closure or a lambda;
by reference where importable), and its functions are pickled into bytes of their own:
a process that cannot load them still gets the mark, so the task is placed, and the
task alone errs, naming the step, where it runs and still cannot load it.
:mod:`accelsched.dual` builds its steps' ``__reduce__`` from these pieces.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import cloudpickle

__all__ = ["Unloadable", "importable", "ship", "unpickle"]


class Unloadable:
    """Stands for a step's function that this process could not load.

    Calling it raises, naming the step and why; pickled again it carries what it was
    loaded from, so a worker that has the step's module loads the real step.
    """

    def __init__(self, label: str, error: str, reload: tuple[Any, ...]) -> None:
        self.label = label
        self.error = error
        self.reload = reload  # (loader, args without the mark)
        self.__name__ = self.__qualname__ = label

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"accelsched step {self.label} could not be loaded in this process: "
            f"{self.error}. Install the modules it needs where it runs (a scheduler needs "
            "none of them: it only reads the step's mark)"
        )

    def reduce_with(self, mark: Any) -> tuple[Any, ...]:
        """How to load it again: its loader and arguments, the mark (if any) last, as
        every loader of :mod:`accelsched.dual` takes it."""
        loader, args = self.reload
        return (loader, args if mark is None else (*args, mark))

    def __reduce__(self) -> tuple[Any, ...]:
        return self.reduce_with(None)

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
    ):
        return None
    module = sys.modules.get(module_name)
    if module is None or getattr(module, "__spec__", None) is None:  # dynamic
        return None
    # registered by value: the module or a package above it
    by_value = cloudpickle.list_registry_pickle_by_value()
    if any(module_name == m or module_name.startswith(f"{m}.") for m in by_value):
        return None
    target: Any = module
    for part in qualname.split("."):
        target = getattr(target, part, None)
    return (module_name, qualname) if target is obj else None


_shipping = threading.local()


def ship(step: Any, functions: Any) -> bytes | None:
    """``functions`` pickled apart, or None while ``step`` is being shipped already: a
    recursive step reaches itself through its own globals, and only the enclosing
    pickler's memo can close that cycle.

    A step loaded from bytes sends the same bytes on (the scheduler passes steps
    through); one made here is pickled anew each time, as a plain function is, so a
    notebook's changed globals travel with it.
    """
    loaded: bytes | None = getattr(step, "shipped", None)
    if loaded is not None:
        return loaded
    busy: set[int] = _shipping.__dict__.setdefault("busy", set())
    if id(step) in busy:
        return None
    busy.add(id(step))
    try:
        return cloudpickle.dumps(functions, protocol=5)
    finally:
        busy.discard(id(step))


def unpickle(label: str, payload: bytes) -> tuple[Any, str | None]:
    try:
        return cloudpickle.loads(payload), None
    except Exception as exc:  # ModuleNotFoundError, AttributeError, anything it raised
        return None, f"{type(exc).__name__}: {exc}"
