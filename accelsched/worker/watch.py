"""Watching tasks that asked for no GPU: did they use one anyway?

Device memory is read per process, so a task's growth can be blamed on it only when it
ran alone: each worker's :class:`~accelsched.policy.leases.LeaseTable` records the tasks
running in its threads (the guard's transition hook feeds it, so unwatched tasks count
too), and a watched task's readings count only when no other task of any worker in the
process started or ended while it ran.
:func:`accelsched.policy.leak.classify` decides what the readings mean.

Reading NVML costs tens of microseconds per device, twice per task: on a worker that sees
8 GPUs that is more than a tiny task itself. Using a GPU is a property of the code a task
runs, so the watch samples per task prefix: the first :data:`FIRST_RUNS` runs of each
prefix on each worker, then one run in :data:`EVERY`. With ``unrequested_gpu="fail"``
every task is watched, since a task that uses a GPU must then fail, not a later one.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from accelsched import events
from accelsched.devices.nvml import DeviceInfo, MemoryReading, NVMLMonitor
from accelsched.policy.leak import classify
from accelsched.policy.leases import LeaseTable

__all__ = [
    "TABLES",
    "UnrequestedGPUUse",
    "Watch",
    "FIRST_RUNS",
    "EVERY",
]

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


#: Every worker's record of what runs in its threads, in this process (the guards add
#: theirs at setup): device memory is read per process, so a task ran alone only when no
#: task of any of them ran beside it.
TABLES: weakref.WeakSet[LeaseTable] = weakref.WeakSet()


def _changes() -> tuple[int, int]:
    """Tasks started or ended so far in this process, and tasks running now: a task ran
    alone when it was the only one running at its start and the first count is the same
    at its end."""
    tables = list(TABLES)  # a copy: a table may be collected meanwhile
    return sum(t.changes for t in tables), sum(t.running() for t in tables)


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
        n = self._runs.get(prefix, 0) + 1
        if n == 1 and len(self._runs) >= MAX_PREFIXES:
            self._runs.clear()
        self._runs[prefix] = n
        return n <= FIRST_RUNS or n % EVERY == 0

    def runner(self, key: Any) -> Runner:
        def run(spec: Any, values: dict) -> Any:
            changes, running = _changes()
            before = self._readings() if running <= 1 else None
            result = spec(values)
            if before is None or _changes()[0] != changes:  # another task ran meanwhile
                return result
            for use in classify(before, self._readings()):
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
