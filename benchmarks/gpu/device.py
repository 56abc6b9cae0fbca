"""Device 0, real (CuPy) or simulated, and the timers the GPU benchmark measures it with.

On a GPU, allocation and freeing go through CuPy; with ``--fake``, through the simulated
pool of ``accelsched.testing``: the same measurements run both ways, so the dry run on a
CPU machine exercises every line the GPU run will.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable
from typing import Any

MiB = 2**20
GiB = 2**30
FAKE_LABEL = "FAKE GPUs (accelsched.testing.fake_gpus on the CPU): NOT GPU FIGURES"


def per_call_us(
    fn: Callable[[], Any], n: int, rounds: int = 5, warmup: int = 20, budget_s: float = 0.25
) -> dict:
    """Median and min over ``rounds`` of the mean µs per call of ``fn``.

    A round is ``n`` calls, or fewer when that would take longer than ``budget_s``.
    """
    t0 = time.perf_counter()
    for _ in range(warmup):
        fn()
    each = (time.perf_counter() - t0) / max(warmup, 1)
    if each > 0:
        n = max(20, min(n, int(budget_s / each)))
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        samples.append((time.perf_counter() - t0) / n * 1e6)
    return {
        "median_us": round(statistics.median(samples), 3),
        "min_us": round(min(samples), 3),
        "calls": n * rounds,
    }


def stamp(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    value = fn()
    return (time.perf_counter() - t0) * 1e6, value


def environment(fake: bool) -> dict:
    """The devices and driver the figures come from. Versions, machine and commit are in
    every result file's provenance (:mod:`benchmarks.harness.provenance`)."""
    from accelsched.devices import NVMLMonitor

    env: dict[str, Any] = {
        "mode": "fake" if fake else "gpu",
        "label": FAKE_LABEL if fake else "real GPU",
    }
    m = NVMLMonitor()
    env["devices"] = [d.as_dict() for d in m.devices()]
    if not fake and m.available:
        nvml = m._nvml
        with contextlib.suppress(Exception):
            env["driver"] = _text(nvml.nvmlSystemGetDriverVersion())
        with contextlib.suppress(Exception):
            env["cuda_driver"] = nvml.nvmlSystemGetCudaDriverVersion()
    return env


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class Device:
    """Allocation, context and freeing on device 0, real or simulated."""

    def __init__(self, fake: bool) -> None:
        self.fake = fake
        from accelsched.devices import NVMLMonitor

        self.monitor = NVMLMonitor()
        if not self.monitor.devices():
            raise RuntimeError(f"no GPU visible: {self.monitor.reason}")
        if not fake:
            import cupy

            self.cp = cupy
            cupy.cuda.Device(0).use()

    def context(self) -> None:
        if self.fake:
            from accelsched.testing import create_context

            create_context(device=0)
        else:
            self.cp.cuda.Device(0).synchronize()

    def alloc(self, nbytes: int) -> Any:
        if self.fake:
            from accelsched.testing import device_alloc

            return device_alloc(nbytes, device=0)
        return self.cp.empty(nbytes, dtype=self.cp.uint8)

    def sync(self) -> None:
        if not self.fake:
            self.cp.cuda.Device(0).synchronize()

    def pools(self) -> list:
        from accelsched.devices import active_pools

        return active_pools()

    def free_all(self) -> int:
        return sum(p.free_all() for p in self.pools())

    def process_bytes(self) -> int:
        return self.monitor.process_memory(0).nbytes


def no_event(action: str, **figures: Any) -> None:
    """Stands in for the guard's event sender outside a worker."""
