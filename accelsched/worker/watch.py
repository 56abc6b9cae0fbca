"""Watching tasks that asked for no GPU: did they use one anyway?

Device memory is read per process, so a task's growth can be blamed on it only when it
ran alone: :class:`Activity` counts the tasks executing in this process, across all its
workers (the guard's transition hook feeds it, so unwatched tasks count too), and a
watched task's readings count only when no other task started or ended while it ran.
:func:`accelsched.policy.unrequested.classify` decides what the readings mean.

Reading NVML costs tens of microseconds per device, twice per task: on a worker that sees
8 GPUs that is more than a tiny task itself. Using a GPU is a property of the code a task
runs, so the watch samples per task prefix: the first :data:`FIRST_RUNS` runs of each
prefix on each worker, then one run in :data:`EVERY`. With ``unrequested_gpu="fail"``
every task is watched, since a task that uses a GPU must then fail, not a later one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from accelsched import events
from accelsched.devices.nvml import DeviceInfo, MemoryReading, NVMLMonitor
from accelsched.policy.unrequested import classify

__all__ = ["Activity", "ACTIVITY", "Running", "UnrequestedGPUUse", "Watch", "FIRST_RUNS", "EVERY"]

Runner = Callable[[Any, dict], Any]

#: Runs of each task prefix watched before sampling starts.
FIRST_RUNS = 4
#: After that, one run in this many is watched.
EVERY = 64
#: Prefixes remembered per worker; beyond this the counts start over (names made per
#: task must not grow memory forever).
MAX_PREFIXES = 10_000


class UnrequestedGPUUse(RuntimeError):
    """A task that did not ask for a GPU used one (``unrequested_gpu="fail"``)."""


class Activity:
    """Tasks executing in this process; tells a watched task whether it ran alone.

    ``started``/``finished`` run on the workers' event loops (transition hooks), the
    token calls in executor threads.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running = 0
        self.generation = 0

    def started(self) -> None:
        with self.lock:
            self.running += 1
            self.generation += 1

    def finished(self) -> None:
        with self.lock:
            self.running = max(0, self.running - 1)
            self.generation += 1

    def alone_token(self) -> int | None:
        """A token when the calling task is the only one executing, else None."""
        with self.lock:
            return self.generation if self.running <= 1 else None

    def still_alone(self, token: int | None) -> bool:
        with self.lock:
            return token is not None and self.generation == token


ACTIVITY = Activity()


class Running:
    """The keys whose functions run in one worker's threads, each counted once in
    :data:`ACTIVITY` (every task, watched or not) until its function returns.

    A task released while it executes (``cancelled``) runs on in its thread:
    ``in_thread(key)`` tells, and ``on_end()`` is called as each one ends (worker event
    loop).
    """

    def __init__(self, in_thread: Callable[[Any], bool], on_end: Callable[[], None]) -> None:
        self.keys: set[Any] = set()
        self._in_thread = in_thread
        self._on_end = on_end

    def started(self, key: Any) -> None:
        if key not in self.keys:
            self.keys.add(key)
            ACTIVITY.started()

    def ended(self, key: Any) -> None:
        if key in self.keys:
            self.keys.discard(key)
            ACTIVITY.finished()
            self._on_end()

    def recount(self, key: Any) -> None:
        """``key`` changed state: started or ended, as its thread says."""
        if self._in_thread(key):
            self.started(key)
        else:
            self.ended(key)

    def clear(self) -> None:
        """What it counted no longer runs under this guard (unregistered)."""
        for _ in self.keys:
            ACTIVITY.finished()
        self.keys.clear()


class Watch:
    """Reads this process's device memory around unannotated tasks that ran alone."""

    def __init__(
        self,
        *,
        monitor: NVMLMonitor,
        visible: list[DeviceInfo],
        fail: bool,
        emit: Callable[..., None],
    ) -> None:
        self.monitor = monitor
        self.visible = visible
        self.fail = fail
        self._emit = emit
        self._runs: dict[str, int] = {}  # prefix -> runs seen on this worker

    def sampled(self, prefix: str) -> bool:
        """Whether this run of ``prefix`` is watched (event loop)."""
        if self.fail:
            return True
        runs = self._runs
        n = runs.get(prefix, 0) + 1
        if n == 1 and len(runs) >= MAX_PREFIXES:
            runs.clear()
        runs[prefix] = n
        return n <= FIRST_RUNS or n % EVERY == 0

    def runner(self, key: Any) -> Runner:
        def run(spec: Any, values: dict) -> Any:
            token = ACTIVITY.alone_token()
            before = self._readings() if token is not None else None
            result = spec(values)
            if before is not None and ACTIVITY.still_alone(token):
                self._judge(key, before, self._readings())
            return result

        return run

    def _readings(self) -> dict[int, MemoryReading]:
        """This process's memory on each device that answers NVML (a failing device is
        the leak check's business, never the task's)."""
        out = {}
        for d in self.visible:
            try:
                out[d.index] = self.monitor.process_memory(d.index)
            except Exception:
                continue
        return out

    def _judge(
        self, key: Any, before: dict[int, MemoryReading], after: dict[int, MemoryReading]
    ) -> None:
        for use in classify(before, after):
            self._emit(
                events.UNREQUESTED_GPU_USE,
                key=key,
                device=use.device,
                nbytes=use.nbytes,
                context_created=use.context_created,
                failed=self.fail,
            )
            if self.fail:
                raise UnrequestedGPUUse(
                    f"task {key!r} did not ask for a GPU but used device {use.device} "
                    f"({'created a CUDA context, ' if use.context_created else ''}"
                    f"device memory grew by {use.nbytes} bytes); annotate it with "
                    f"dask.annotate(resources={{'GPU': 1}})"
                )
