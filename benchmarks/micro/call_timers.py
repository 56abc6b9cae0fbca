"""Timers set on a live object's methods, and on a worker's executor thread.

The hot-path benchmark times the guard's pieces where they run, inside a worker, by
replacing each method on its owner instance for the length of a round: nothing in
accelsched knows it is timed, and a piece renamed in the code shows up as absent instead
of silently timing nothing. What a timer adds to what it times is measured
(:func:`timer_ns`) and taken off by the caller.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any


class Timer:
    """Wraps one callable: the ns of each call (``clock``: perf_counter_ns, or
    thread_time_ns where a preemption must not count)."""

    def __init__(self, fn: Callable[..., Any], clock: Callable[[], int]) -> None:
        self.fn = fn
        self.clock = clock
        self.ns: list[int] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        clock = self.clock
        t0 = clock()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.ns.append(clock() - t0)


class HookTimer(Timer):
    """Times the transition hook per kind of transition (``start -> finish``)."""

    def __init__(self, fn: Callable[..., Any], clock: Callable[[], int]) -> None:
        super().__init__(fn, clock)
        self.kinds: dict[str, list[int]] = {}

    def __call__(self, key: Any, start: str, finish: str, **kwargs: Any) -> Any:
        t0 = time.perf_counter_ns()
        try:
            return self.fn(key, start, finish, **kwargs)
        finally:
            self.kinds.setdefault(f"{start}->{finish}", []).append(time.perf_counter_ns() - t0)


class CallCounter(Timer):
    """Counts the function calls (Python and C) made inside each call of the callable it
    wraps, in the calling thread (the worker's event loop, for the transition hook): a
    figure that does not move with the machine's load, where a timing does. The wrapped
    call itself counts one; the profiler's removal is not counted. Finalizers or a GC
    pass run inside a call count too: the figure moves by a call or so between runs."""

    def __init__(self, fn: Callable[..., Any], clock: Callable[[], int]) -> None:
        super().__init__(fn, clock)
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        count = 0

        def profile(frame: Any, event: str, arg: Any) -> None:
            nonlocal count
            if event in ("call", "c_call"):
                count += 1

        before = sys.getprofile()  # a profiler already set on this thread is set back
        sys.setprofile(profile)
        try:
            return self.fn(*args, **kwargs)
        finally:
            sys.setprofile(before)
            self.calls += count - 1  # (the c_call of setprofile(before))
            self.ns.append(0)  # one entry per call, as a Timer's


def calls_inside(root: Any, path: str, run: Callable[[], Any], n: int) -> float:
    """The function calls (Python and C) made inside ``root.<path>`` per task while
    ``run()`` runs ``n`` tasks, its own calls included (:class:`CallCounter`)."""
    with timed(root, path, kind=CallCounter) as counter:
        run()
    return round(counter.calls / n, 1)


def timer_ns(clock: Callable[[], int], n: int = 20000) -> float:
    """What a :class:`Timer` adds to what it times (median over a no-op): subtracted."""
    timer = Timer(lambda *args, **kwargs: None, clock)
    for _ in range(n):
        timer("key", "start", "finish")
    return float(statistics.median(timer.ns))


def _resolve(root: Any, path: str) -> tuple[Any, str] | None:
    *owners, attr = path.split(".")
    obj = root
    for name in owners:
        obj = getattr(obj, name, None)
        if obj is None:
            return None
    return (obj, attr) if callable(getattr(obj, attr, None)) else None


@contextlib.contextmanager
def timed(
    root: Any,
    path: str,
    clock: Callable[[], int] = time.perf_counter_ns,
    kind: type[Timer] = Timer,
) -> Iterator[Any]:
    """Time ``root.<path>`` (set on its owner instance) for the block's duration."""
    found = _resolve(root, path)
    if found is None:
        yield None
        return
    owner, attr = found
    had = attr in getattr(owner, "__dict__", {})
    timer = kind(getattr(owner, attr), clock)
    setattr(owner, attr, timer)
    try:
        yield timer
    finally:
        if had:
            setattr(owner, attr, timer.fn)
        else:
            delattr(owner, attr)


@contextlib.contextmanager
def thread_cpu(worker: Any) -> Iterator[list[int]]:
    """The executor thread's CPU ns per task run through the worker's default executor."""
    executor = worker.executors["default"]
    submit = executor.submit
    cpu: list[int] = []

    def timed_submit(fn: Callable[[], Any], *args: Any, **kwargs: Any) -> Any:
        def timed() -> Any:
            t0 = time.thread_time_ns()
            try:
                return fn()
            finally:
                cpu.append(time.thread_time_ns() - t0)

        return submit(timed, *args, **kwargs)

    executor.submit = timed_submit
    try:
        yield cpu
    finally:
        del executor.submit


def calls_per_call(call: Callable[[int], Any], n: int) -> float:
    """Function calls (Python and C) made per ``call(i)``, over ``n`` calls in this thread.

    Deterministic where a timing is not: what a task's path costs inside a busy worker
    (its code and data cold in the cache between tasks) grows with the calls it makes,
    which a tight loop's timing hides."""
    count = [0]

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event in ("call", "c_call"):
            count[0] += 1

    sys.setprofile(profile)
    try:
        for i in range(n):
            call(i)
    finally:
        sys.setprofile(None)
    return round(count[0] / n, 1)
