"""Watching tasks that asked for no GPU: did they use one anyway?

Device memory is read per process, so a task's growth can be blamed on it only when it
ran alone: :class:`Activity` counts the wrapped tasks (GPU or watched) running in this
process, across all its workers, and a watched task's readings count only when no other
wrapped task started or ended while it ran. :func:`accelsched.unrequested.classify`
decides what the readings mean.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from accelsched import events
from accelsched.devices.nvml import DeviceInfo, MemoryReading, NVMLMonitor
from accelsched.unrequested import classify

__all__ = ["Activity", "ACTIVITY", "UnrequestedGPUUse", "Watch"]

Runner = Callable[[Any, dict], Any]


class UnrequestedGPUUse(RuntimeError):
    """A task that did not ask for a GPU used one (``unrequested_gpu="fail"``)."""


class Activity:
    """Wrapped tasks running in this process; tells a watched task whether it ran alone."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running = 0
        self.generation = 0

    def enter(self) -> int | None:
        """Count a task in; return a token when it is alone, else None."""
        with self.lock:
            alone = self.running == 0
            self.running += 1
            self.generation += 1
            return self.generation if alone else None

    def still_alone(self, token: int | None) -> bool:
        with self.lock:
            return token is not None and self.generation == token

    def exit(self) -> None:
        with self.lock:
            self.running -= 1
            self.generation += 1


ACTIVITY = Activity()


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

    def runner(self, key: Any) -> Runner:
        def run(spec: Any, values: dict) -> Any:
            token = ACTIVITY.enter()
            try:
                before = self._readings() if token is not None else None
                result = spec(values)
                if before is not None and ACTIVITY.still_alone(token):
                    self._judge(key, before, self._readings())
                return result
            finally:
                ACTIVITY.exit()

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
