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

import functools
import itertools
import types
from collections import deque
from dataclasses import dataclass
from typing import Any

from accelsched.policy.requirements import (
    Requirement,
    combine,
    invalid_amount,
    requirement_problem,
)

__all__ = ["MARK_ATTRIBUTE", "Mark", "mark_of", "mark_problem", "find_mark", "MAX_VISITS"]

#: The attribute a marked callable carries: a :class:`Mark`.
MARK_ATTRIBUTE = "__accelsched_gpu__"

#: At most this many objects are looked at per task: a task is a small tree of calls,
#: and the walk must never cost what the task's data would (arrays are never entered).
MAX_VISITS = 1000
#: Of a long list or dict argument, only this many items are looked at, and those after
#: them only as long as they are calls (a fused task's subgraph: one task per step it runs,
#: however long the chain): data, not calls.
MAX_ITEMS = 64

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
    ``fallback_timeout=None``, strict). ``cpu_form``: the timeout a step with a CPU form
    (``dual``) falls back after when neither the task, the step nor the plugin gives one
    (None: strict, a GPU-only step)."""

    count: float = 1
    timeout: float | None = None
    timeout_given: bool = False
    cpu_form: float | None = None
    #: What each device it holds must be (:mod:`accelsched.policy.requirements`).
    requirement: Requirement | None = None


def mark_problem(mark: Mark) -> str | None:
    """Why ``mark`` cannot be taken as is, or None when it can.

    A mark arrives unpickled, so the scheduler checks it as strictly as :func:`gpu` checks
    its arguments (its count by the rule of a ``GPU`` resource): a NaN or string timeout
    would otherwise sit in the fallback heap where no deadline ever passes, holding up
    every fallback queued behind it.
    """
    if invalid_amount(mark.count) is not None:
        return f"invalid GPU step mark count={mark.count!r}: expected a positive number of GPUs"
    # getattr: a mark pickled before it had a requirement
    if (problem := requirement_problem(getattr(mark, "requirement", None))) is not None:
        return f"invalid GPU step mark: {problem}"
    if not isinstance(mark.timeout_given, bool):
        return f"invalid GPU step mark timeout_given={mark.timeout_given!r}"
    for name, seconds in (("fallback_timeout", mark.timeout), ("cpu_form", mark.cpu_form)):
        # zero is a timeout (fall back at once), no amount
        bad = isinstance(seconds, bool) or (seconds != 0 and invalid_amount(seconds) is not None)
        if seconds is not None and bad:
            return (
                f"invalid GPU step mark {name}={seconds!r}: expected None or a "
                "finite, non-negative number of seconds"
            )
    return None


def mark_of(obj: Any) -> Mark | None:
    """The mark ``obj`` carries, if any (never raises: any object may be asked)."""
    try:
        mark = getattr(obj, MARK_ATTRIBUTE, None)
    except Exception:
        return None
    return mark if isinstance(mark, Mark) else None


_ATOMS = frozenset({str, bytes, int, float, complex, bool, type(None)})
#: Callables whose type's ``__call__`` is never a marked step.
_PLAIN_CALLABLES = frozenset(
    {types.FunctionType, types.BuiltinFunctionType, types.MethodType, functools.partial, type}
)
_CONTAINERS = (dict, list, tuple, set, frozenset)
_CALLS = ("func", "funcs", "first", "value")
_ARGS = ("args", "kwargs", "keywords")
_ARGUMENTS = (tuple, list, dict)


@dataclass(frozen=True)
class _Plan:
    """What the walk reads of objects of one type, decided at the first one seen."""

    data: bool  # an array: never entered
    reads: tuple[str, ...]  # of func/funcs/first/value and args/kwargs/keywords, those it has
    call_mark: Mark | None  # a callable instance whose class's (inherited) __call__ is marked


#: Per type, what to read: a graph has thousands of tasks of a handful of types, and
#: asking every object for seven attributes it mostly lacks cost more than the rest.
_PLANS: dict[type, _Plan] = {}


def _has(obj: Any, name: str) -> bool:
    try:
        return getattr(obj, name, None) is not None
    except Exception:
        return False


def _exists(obj: Any, name: str) -> bool:
    """Whether objects of this type have ``name`` at all: a plan must not follow the
    first instance's value (a ``DataNode`` holding None has a ``value`` the next one
    fills with a marked step)."""
    try:
        getattr(obj, name)
    except AttributeError:
        return False
    except Exception:
        return True  # it misbehaves here; each instance is read under its own guard
    return True


def _plan(obj: Any) -> _Plan:
    """What to read of objects of ``obj``'s type (none planned yet), planned now."""
    cls = type(obj)
    data = _has(obj, "__array__") or _has(obj, "__cuda_array_interface__")
    # the __call__ its class defines or inherits
    call = (
        None
        if cls in _PLAIN_CALLABLES
        else next((c.__dict__["__call__"] for c in cls.__mro__ if "__call__" in c.__dict__), None)
    )
    plan = _Plan(
        data, () if data else tuple(n for n in _CALLS + _ARGS if _exists(obj, n)), mark_of(call)
    )
    if len(_PLANS) < 4096:  # types made on the fly must not grow this forever
        _PLANS[cls] = plan
    return plan


def find_mark(spec: Any, max_visits: int = MAX_VISITS) -> Mark | None:
    """The GPU requirement of a task: the marks of every step it calls, combined.

    Several marked steps in one task (fused) need as many GPUs as the largest of them; a
    step's own fallback timeout counts when only one is given (several: the shortest; one
    of them strict, ``fallback_timeout=None``: strict); the task has a CPU form only when
    every step has one (a GPU-only step keeps it strict by default).
    """
    if not _seen:
        return None
    found: list[Mark] = []
    queue = deque((spec,))  # breadth first: a task's own function before its arguments'
    seen: set[int] = set()
    visits = 0
    atoms = _ATOMS
    # a long container's items past MAX_ITEMS: walked once all else is (so a fused
    # subgraph's hundreds of tasks do not spend the walk before a step deeper in its first)
    later: deque[Any] = deque()

    def glance(added: int) -> Mark | None:
        """A first look at the items just put off: each one, and the function it calls
        (a fused task's), whose mark is taken now, however much of the walk the others'
        insides take before it reaches them; a mark the task errs on, or None."""
        for item in itertools.islice(reversed(later), added):
            try:
                calls = (item, getattr(item, "func", None))
            except Exception:  # an object whose attributes misbehave: nothing to learn
                continue
            for one in calls:
                if (mark := mark_of(one)) is not None and id(one) not in seen:
                    seen.add(id(one))
                    if mark_problem(mark) is not None:
                        return mark
                    found.append(mark)
        return None

    while (queue or later) and visits < max_visits:
        if not queue:
            queue, later = later, queue
        obj = queue.popleft()
        cls = type(obj)
        if cls in atoms:
            continue
        if cls is tuple or cls is list:
            visits += 1
            if bad := glance(_items(obj, queue, later, max_visits - visits)):
                return bad
            continue
        ident = id(obj)
        if ident in seen:
            continue
        seen.add(ident)
        visits += 1
        if isinstance(obj, _CONTAINERS):
            items = obj.values() if isinstance(obj, dict) else obj
            if bad := glance(_items(items, queue, later, max_visits - visits)):
                return bad
            continue
        mark = mark_of(obj)
        if mark is None:
            try:
                plan = _PLANS.get(cls) or _plan(obj)
                mark = plan.call_mark  # an instance that is a marked step when called
                if mark is None and not plan.data:  # data, however large: no calls in there
                    # what a task node or a callable nests: a Task (func/args/kwargs),
                    # functools.partial (func/args/keywords), a composition (funcs,
                    # first), a graph's data node (value: a fused task's functions
                    # travel so); a call, whatever it is, arguments only as a sequence
                    # or mapping to look into
                    for name in plan.reads:
                        try:
                            value = getattr(obj, name, None)
                        except Exception:
                            continue
                        if value is not None and (
                            name in _CALLS or (isinstance(value, _ARGUMENTS) and value)
                        ):
                            queue.append(value)
            except Exception:  # an object whose attributes misbehave: nothing to learn there
                continue
        if mark is not None:
            if mark_problem(mark) is not None:
                return mark  # the task errs, naming it: nothing to combine
            found.append(mark)
    if not found:
        return None
    given = [m.timeout for m in found if m.timeout_given]
    cpu_forms = [m.cpu_form for m in found if m.cpu_form is not None]
    return Mark(
        count=max(m.count for m in found),
        # a step marked strict keeps the task it is fused into strict, whatever the others
        # allow: it must never run on the host (before: the shortest of theirs, and it ran
        # there once one of them timed out)
        timeout=None if None in given else min((t for t in given if t is not None), default=None),
        timeout_given=bool(given),
        requirement=combine([m.requirement for m in found if m.requirement]),
        cpu_form=min(cpu_forms) if len(cpu_forms) == len(found) else None,
    )


def _items(items: Any, queue: deque[Any], later: deque[Any], budget: int) -> int:
    """Queue the items of a container the walk looks at: its first :data:`MAX_ITEMS`,
    then (``later``) those after them while they are calls, as long as the walk's
    ``budget`` of visits left is not spent on what is queued already; how many went
    ``later``."""
    it = iter(items)
    queue.extend(itertools.islice(it, MAX_ITEMS))
    if (room := budget - len(queue) - len(later)) <= 0:
        return 0
    before = len(later)
    # data, not calls (a Timestamp, an Enum member): never callable
    later.extend(itertools.islice(itertools.takewhile(callable, it), room))
    return len(later) - before
