"""The GPU benchmark's measurements on a cluster: tiny GPU tasks with and without the
plugins, then a real leak: its detection and the worker's restart to ready.

One scheduler and two nannies in this process's event loop: one worker owning GPU 0,
one seeing none (the peer the leaking worker's results move to).
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from benchmarks.gpu.device import MiB


def tiny_task(i: int) -> int:
    return i


def gpu_tiny_task(i: int) -> int:
    import accelsched

    return i if accelsched.current_device() is not None else -1


def leak_task(nbytes: int, fake: bool) -> float:
    """Keep ``nbytes`` of device memory referenced forever; return the wall time it ended."""
    holder = sys.modules.setdefault("_accelsched_bench_leak", type(sys)("_accelsched_bench_leak"))
    kept = holder.__dict__.setdefault("kept", [])
    if fake:
        from accelsched.testing import device_alloc

        kept.append(device_alloc(nbytes))
    else:
        import cupy

        kept.append(cupy.zeros(nbytes, dtype=cupy.uint8))
        cupy.cuda.Device().synchronize()
    return time.time()


async def _events(client: Any, action: str) -> list[tuple[float, dict]]:
    found = await client.get_events("accelsched")
    return [(t, m) for t, m in found if m.get("action") == action]


async def _until(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = await predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)


async def _timed_batch(client: Any, fn: Callable, n: int, tag: str) -> float:
    import dask

    with dask.annotate(resources={"GPU": 1}):
        futures = client.map(fn, range(n), key=[f"{tag}-{i}" for i in range(n)])
    t0 = time.perf_counter()
    await client.gather(futures)
    elapsed = time.perf_counter() - t0
    del futures
    return elapsed / n * 1e6


async def cluster_bench(fake: bool, quick: bool, out: dict[str, Any]) -> None:
    """Fills ``out`` as it goes, so a later phase failing keeps the earlier figures."""
    from distributed import Client, Nanny, Scheduler

    import accelsched

    n = 100 if quick else 300
    async with (
        Scheduler(dashboard=False, port=0) as s,
        Nanny(
            s.address, nthreads=1, env={"CUDA_VISIBLE_DEVICES": "0"}, resources={"GPU": 1}
        ) as gpu,
        Nanny(s.address, nthreads=1, env={"CUDA_VISIBLE_DEVICES": ""}) as _cpu,
        Client(s.address, asynchronous=True) as c,
    ):
        # without the plugins: distributed alone places on the declared resource
        await _timed_batch(c, tiny_task, n, "warm")
        without = [await _timed_batch(c, tiny_task, n, f"bare{r}") for r in range(3)]
        await accelsched.register(  # type: ignore[misc]
            c, check_interval="100ms", leak_threshold="256MiB", leak_confirmations=2
        )

        async def verified() -> list:
            return await _events(c, "gpu-verified")

        await _until(verified, 30, "gpu-verified")
        await _timed_batch(c, gpu_tiny_task, n, "gwarm")  # context creation happens here
        with_ = [await _timed_batch(c, gpu_tiny_task, n, f"guard{r}") for r in range(3)]
        out["cluster_tasks"] = {
            "tasks_per_batch": n,
            "without_plugins_us": round(statistics.median(without), 1),
            "with_plugins_us": round(statistics.median(with_), 1),
            "difference_us": round(statistics.median(with_) - statistics.median(without), 1),
            "all_without_us": [round(x, 1) for x in without],
            "all_with_us": [round(x, 1) for x in with_],
        }

        # a leak: detection latency, then the lossless restart and the worker's return
        import dask

        kept = c.submit(tiny_task, 7, key="kept-result", workers=[gpu.worker_address])
        await kept
        old = gpu.worker_address
        with dask.annotate(resources={"GPU": 1}):
            ended = await c.submit(leak_task, 512 * MiB, fake, key="leaky-bench")

        async def leaked() -> list:
            return await _events(c, "leak")

        (t_leak, leak), *_ = await _until(leaked, 30, "a leak event")
        found = out["leak_and_restart"] = {
            "leak_bytes": 512 * MiB,
            "estimate_bytes": leak.get("nbytes"),
            "check_interval_s": 0.1,
            "confirmations": 2,
            "detection_s": round(t_leak - ended, 3),
            "detection_checks": leak.get("checks"),
        }

        async def back() -> list:
            return [
                (t, m)
                for t, m in await _events(c, "gpu-verified")
                if m.get("worker") != old and t > t_leak
            ]

        (t_back, _), *_ = await _until(back, 60, "the restarted worker verified")
        restarts = await _events(c, "restart")
        t_restart, restart = restarts[0] if restarts else (None, {})
        found.update(
            {
                "restart_event_after_s": None
                if t_restart is None
                else round(t_restart - t_leak, 3),
                "restart_reported_s": restart.get("seconds"),
                "moved_keys": restart.get("moved"),
                "restart_to_ready_s": round(t_back - t_leak, 3),
                "kept_result_survived": (await kept) == 7,
            }
        )


def bench_cluster(fake: bool, quick: bool) -> dict:
    out: dict[str, Any] = {}
    try:
        asyncio.run(asyncio.wait_for(cluster_bench(fake, quick, out), 150))
    except Exception as exc:
        exc.partial = out  # type: ignore[attr-defined]
        raise
    return out
