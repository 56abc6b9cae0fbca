"""GPU steps marked in code: the requirement travels with the callable, not the graph.

``dask.annotate`` attaches resources to graph layers, and both dask.array's low-level
fusion (dask#7036) and dask-expr's query planning (dask#10937) drop them. A ``dual`` or
``@accelsched.gpu`` object instead carries a mark (:data:`MARK_ATTRIBUTE`), and the
scheduler, which unpickles every task's function with the graph, looks for it in each new
task: the function it calls, and whatever callables that task nests (a fused dask.array
task, a DataFrame partition's ``apply_and_enforce(_func=...)``, a ``functools.partial``, a
composed function). A task calling a marked step anywhere is a GPU task. Decisions only:
no distributed import, and no dask internals (the walk goes by attributes).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

__all__ = ["MARK_ATTRIBUTE", "Mark", "mark_of", "find_mark", "MAX_VISITS"]

#: The attribute a marked callable carries: a :class:`Mark`.
MARK_ATTRIBUTE = "__accelsched_gpu__"

#: At most this many objects are looked at per task: a task is a small tree of calls,
#: and the walk must never cost what the task's data would (arrays are never entered).
MAX_VISITS = 1000
#: Of a long list or dict argument, only this many items are looked at: data, not calls.
MAX_ITEMS = 64

_NO_TIMEOUT: Any = None

#: Whether this process ever built (or unpickled) a marked step: until then no task can
#: call one, and the scheduler skips the walk altogether.
_seen = False


def note_marked() -> None:
    """A marked step exists in this process (``dual``/``gpu`` call this)."""
    global _seen
    _seen = True


@dataclass(frozen=True)
class Mark:
    """What a marked step needs: ``count`` GPUs, and its own fallback timeout (seconds;
    None: the plugin's default; ``timeout_given`` tells None-the-default from an explicit
    ``fallback_timeout=None``, strict)."""

    count: float = 1
    timeout: float | None = None
    timeout_given: bool = False


def mark_of(obj: Any) -> Mark | None:
    """The mark ``obj`` carries, if any (never raises: any object may be asked)."""
    try:
        mark = getattr(obj, MARK_ATTRIBUTE, None)
    except Exception:
        return None
    return mark if isinstance(mark, Mark) else None


def _children(obj: Any) -> Iterator[Any]:
    """What a task node or a callable nests: calls, their arguments, composed functions."""
    if isinstance(obj, dict):
        yield from itertools.islice(obj.values(), MAX_ITEMS)
        return
    if isinstance(obj, (list, tuple, set, frozenset)):
        yield from itertools.islice(obj, MAX_ITEMS)
        return
    if isinstance(obj, (str, bytes, int, float, complex, bool)) or obj is None:
        return
    # a Task (func/args/kwargs), functools.partial (func/args/keywords), a composition
    # (funcs, first), a graph's data node (value: a fused task's functions travel so):
    # whatever of these an object has
    for name in ("func", "funcs", "first", "value"):
        try:
            value = getattr(obj, name, None)
        except Exception:
            value = None
        if value is not None:
            yield value
            if name == "func":  # what is called: an instance whose class's __call__ is marked
                yield type(value).__dict__.get("__call__")
    for name in ("args", "kwargs", "keywords"):
        try:
            value = getattr(obj, name, None)
        except Exception:
            value = None
        if isinstance(value, (tuple, list, dict)):
            yield value


def find_mark(spec: Any, max_visits: int = MAX_VISITS) -> Mark | None:
    """The GPU requirement of a task: the marks of every step it calls, combined.

    Several marked steps in one task (fused) need as many GPUs as the largest of them; a
    step's own fallback timeout counts when only one is given (several: the shortest).
    """
    if not _seen:
        return None
    found: list[Mark] = []
    queue = deque([spec])  # breadth first: a task's own function before its arguments'
    seen: set[int] = set()
    visits = 0
    while queue and visits < max_visits:
        obj = queue.popleft()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        visits += 1
        mark = mark_of(obj)
        if mark is not None:
            found.append(mark)
            continue
        try:
            if hasattr(obj, "__array__") or hasattr(obj, "__cuda_array_interface__"):
                continue  # data, however large: nothing to call in there
            queue.extend(_children(obj))
        except Exception:  # an object whose attributes misbehave: nothing to learn there
            continue
    if not found:
        return None
    given = [m.timeout for m in found if m.timeout_given]
    timeouts = [t for t in given if t is not None]
    return Mark(
        count=max(m.count for m in found),
        timeout=min(timeouts) if timeouts else None,
        timeout_given=bool(given),
    )
