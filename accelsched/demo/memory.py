"""Device memory per worker over the demo's run, read through NVML on each worker.

The report's chart shows what each worker *process* holds on its GPUs: NVML's
per-process figure (``usedGpuMemory``, the number ``nvidia-smi`` lists per process and
the guard's leak check reads), summed over the devices the worker sees. A worker
without a GPU reads 0. The demo's process asks every worker for it a few times a second
(``client.run``); a worker that is restarting misses the samples it cannot answer, and its
successor under the same name is a new process: each sample names its process, so the
chart breaks the line there instead of drawing the old figure across the gap. Each
sample is timed on the worker as it is read (the demo's cluster is local: one clock with
the scheduler's events), not when the reply arrives, which may be a second later while a
worker is busy: a mark then sits on the figure the event saw. On simulated GPUs the
figures are the simulation's (CUDA context, pool blocks, leaked buffers), through the
same pynvml calls.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from types import TracebackType

from distributed import Client, Worker

from accelsched.devices import NVMLMonitor

__all__ = ["Sample", "Sampler", "worker_device_memory"]

_monitor: NVMLMonitor | None = None  # one per worker process: NVML handles are cached


@dataclass(frozen=True)
class Sample:
    """``nbytes`` of device memory held by the worker named ``worker``, ``t`` seconds
    after the demo started, read in its process ``process`` (a restart changes it)."""

    t: float
    worker: str
    nbytes: int
    process: int = 0


def worker_device_memory(dask_worker: Worker) -> tuple[str, int, float, int]:
    """Run on a worker (``client.run`` passes it): its name, its process id, when it read
    (``time.time()``) and the device memory its process holds (all its GPUs)."""
    global _monitor
    if _monitor is None:
        _monitor = NVMLMonitor()
    total = sum(_monitor.process_memory(d.index).nbytes for d in _monitor.devices())
    return str(dask_worker.name), os.getpid(), time.time(), total


class Sampler:
    """Samples :func:`worker_device_memory` on every worker in a background thread while
    the ``with`` block runs; ``samples`` holds what came back."""

    def __init__(self, client: Client, start: float, interval: float = 0.2) -> None:
        if interval <= 0:
            raise ValueError(f"invalid interval={interval!r}: expected seconds > 0")
        self.client = client
        self.start = start
        self.interval = interval
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="accelsched-demo-sampler")
        self._thread.daemon = True  # never keeps the demo alive

    def sample(self) -> None:
        """One reading of every worker that answers (a closing one is left out)."""
        replies = self.client.run(worker_device_memory, on_error="ignore")
        for name, pid, read, nbytes in replies.values():
            self.samples.append(Sample(read - self.start, name, nbytes, pid))

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.sample()
            except Exception:  # the cluster is closing under us: the run is over
                if self._stop.is_set():
                    return

    def __enter__(self) -> Sampler:
        self.sample()
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        if exc_type is None:
            self.sample()  # the end state, after the last step
