"""Device memory as ``nvidia-smi`` would show it, sampled while a benchmark runs.

The benchmark process sees the simulated GPUs through the real ``pynvml`` once it is
inside ``fake_gpus()``; sampling from there, not from the workers, keeps the figure
independent of the code under test.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class MemoryTrace:
    """Device memory as NVML reports it, sampled from this process.

    ``used[d]`` holds ``(seconds since start, bytes used on device d)``; ``ended[d]`` the
    times a process left device ``d`` (its memory released with it): restart markers.
    """

    start: float = field(default_factory=time.monotonic)
    used: dict[int, list[tuple[float, int]]] = field(default_factory=dict)
    ended: dict[int, list[float]] = field(default_factory=dict)

    def peak(self, device: int) -> int:
        return max((b for _, b in self.used.get(device, [])), default=0)

    def as_dict(self) -> dict[str, Any]:
        return {
            "used": {str(d): s for d, s in self.used.items()},
            "ended": {str(d): t for d, t in self.ended.items()},
        }


class MemorySampler:
    """Samples every device's used memory and process list through ``pynvml``.

    The benchmark process sees the simulated GPUs through the real ``pynvml`` once it is
    inside ``fake_gpus()``: these are the readings ``nvidia-smi`` would show. A process
    vanishing from a device's list marks the moment its memory was released (a restart).
    """

    def __init__(self, interval: float = 0.02) -> None:
        import pynvml

        self.nvml = pynvml
        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
        self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        self.interval = interval
        self.trace = MemoryTrace()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory-sampler", daemon=True)

    def __enter__(self) -> MemoryTrace:
        self.trace = MemoryTrace()
        self._thread.start()
        return self.trace

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.nvml.nvmlShutdown()

    def _run(self) -> None:
        seen: dict[int, set[int]] = {}
        while not self._stop.is_set():
            now = time.monotonic() - self.trace.start
            for d, handle in enumerate(self.handles):
                used = self.nvml.nvmlDeviceGetMemoryInfo(handle).used
                self.trace.used.setdefault(d, []).append((now, int(used)))
                pids = {p.pid for p in self.nvml.nvmlDeviceGetComputeRunningProcesses(handle)}
                gone = seen.get(d, set()) - pids
                self.trace.ended.setdefault(d, []).extend(now for _ in gone)
                seen[d] = pids
            self._stop.wait(self.interval)
