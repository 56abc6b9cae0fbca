"""The GPU benchmark's measurements on a cluster: tiny GPU tasks with and without the
plugins in paired rounds, then a real leak: its detection and the worker's restart to
ready.

Everything in this process's event loop: a scheduler with the plugins and two nannies,
one worker owning GPU 0 and one seeing none (the peer the leaking worker's results move
to), and beside it for the paired rounds a plain scheduler whose one worker also uses
GPU 0.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from benchmarks.gpu.device import MiB
from benchmarks.harness.results import spread


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


def make_context(fake: bool) -> int:
    """A CUDA context in this worker process on its task's device, as real GPU work makes
    one (with it, the guard measures GPU tasks around them: a sample of a quiet
    prefix's runs)."""
    import accelsched

    device = accelsched.current_device() or 0
    if fake:
        from accelsched.testing import create_context

        create_context(device)
    else:
        import cupy

        with cupy.cuda.Device(device):
            cupy.zeros(1)
            cupy.cuda.Device().synchronize()
    return device


async def _timed_batch(
    client: Any, gpu_worker: str, fn: Callable, n: int, tag: str, results: list | None = None
) -> tuple[float, float]:
    """µs per task of ``n`` tasks asking for a GPU, wall and CPU of ``gpu_worker``'s
    process (every thread: the event loop, the executor, the guard's checks); their
    results go to ``results``."""
    import dask

    with dask.annotate(resources={"GPU": 1}):
        futures = client.map(fn, range(n), key=[f"{tag}-{i}" for i in range(n)])
    cpu0 = (await client.run(time.process_time, workers=[gpu_worker]))[gpu_worker]
    t0 = time.perf_counter()
    got = await client.gather(futures)
    elapsed = time.perf_counter() - t0
    cpu = (await client.run(time.process_time, workers=[gpu_worker]))[gpu_worker] - cpu0
    if results is not None:
        results.extend(got)
    del futures
    return elapsed / n * 1e6, cpu / n * 1e6


def _guard_interval(dask_worker: Any) -> bool:
    """In the GPU worker: whether the guard registered last checks every 100 ms."""
    import accelsched

    guard = dask_worker.plugins.get(accelsched.GuardPlugin.name)
    return guard is not None and getattr(guard, "options", {}).get("check_interval") == 0.1


def _rounded(values: list[float], digits: int = 1) -> dict[str, float]:
    """:func:`~benchmarks.harness.results.spread`, rounded for the table."""
    return {k: round(v, digits) for k, v in spread(values).items()}


async def _paired(clients: dict[str, tuple[Any, str]], n: int, rounds: int) -> dict[str, Any]:
    """``rounds`` paired batches of ``n`` tiny GPU tasks on a plain cluster and on one
    with the plugins, in alternating order: µs per task end to end, their paired ratio
    and difference (median, min, max)."""
    rows: dict[str, list[float]] = {name: [] for name in clients}
    cpu: dict[str, list[float]] = {name: [] for name in clients}
    results: dict[str, list[int]] = {name: [] for name in clients}
    names = list(clients)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            client, gpu_worker = clients[name]
            wall, worker_cpu = await _timed_batch(
                client, gpu_worker, gpu_tiny_task, n, f"{name}{r}", results[name]
            )
            rows[name].append(wall)
            cpu[name].append(worker_cpu)
    pairs = list(zip(rows["plain"], rows["accelsched"], strict=True))
    cpu_pairs = list(zip(cpu["plain"], cpu["accelsched"], strict=True))
    bound = sum(1 for x in results["accelsched"] if x >= 0)
    if bound != len(results["accelsched"]):  # every one bound to its device, or no figure
        raise RuntimeError(f"{len(results['accelsched']) - bound} GPU task(s) ran unbound")
    return {
        "tasks_per_batch": n,
        "rounds": rounds,
        # the medians of each side (the table's two rows) and the paired figures
        "without_plugins_us": round(statistics.median(rows["plain"]), 1),
        "with_plugins_us": round(statistics.median(rows["accelsched"]), 1),
        "ratio": _rounded([a / p for p, a in pairs], 3),
        "difference_us": _rounded([a - p for p, a in pairs]),
        # the GPU worker's CPU per task (issue 27's target: with / without <= 1.05)
        "worker_cpu_without_us": round(statistics.median(cpu["plain"]), 1),
        "worker_cpu_with_us": round(statistics.median(cpu["accelsched"]), 1),
        "worker_cpu_ratio": _rounded([a / p for p, a in cpu_pairs if p > 0], 3),
        "worker_cpu_difference_us": _rounded([a - p for p, a in cpu_pairs]),
        "all_without_us": [round(x, 1) for x in rows["plain"]],
        "all_with_us": [round(x, 1) for x in rows["accelsched"]],
    }


async def cluster_bench(fake: bool, quick: bool, out: dict[str, Any]) -> None:
    """Fills ``out`` as it goes, so a later phase failing keeps the earlier figures.

    Two clusters share GPU 0: a plain one (its worker declares ``GPU=1``) and one with
    the plugins (its GPU worker and a worker seeing no GPU, the peer a leaking worker's
    results move to). Both workers are started before the plugins are registered (which
    switches this process's nannies to the fork server), and each makes a CUDA context
    first, as real GPU work does. The tiny tasks run on both in paired rounds, the plugins
    with their defaults; the leak, after the plain cluster is gone, on the one with the
    plugins, registered again with checks every 100 ms. Both schedulers share
    this process's event loop: the plugins' scheduler work also slows the plain rounds a
    little, so the difference, if anything, understates their cost."""
    import logging

    from distributed import Client, Nanny, Scheduler

    import accelsched

    n, rounds = (100, 5) if quick else (300, 7)
    gpu_env = {"CUDA_VISIBLE_DEVICES": "0"}
    # errors only, here and in the workers, as the other benchmarks' clusters: the
    # figures are the output (the restart below is the benchmark's, not a warning)
    logging.getLogger("distributed").setLevel(logging.ERROR)
    quiet = logging.ERROR
    async with (
        Scheduler(dashboard=False, dashboard_address=":0", port=0) as s,
        Nanny(s.address, nthreads=1, env=gpu_env, resources={"GPU": 1}, silence_logs=quiet) as gpu,
        Nanny(s.address, nthreads=1, env={"CUDA_VISIBLE_DEVICES": ""}, silence_logs=quiet) as _cpu,
        Client(s.address, asynchronous=True) as c,
    ):
        async with (
            Scheduler(dashboard=False, dashboard_address=":0", port=0) as plain_s,
            Nanny(
                plain_s.address, nthreads=1, env=gpu_env, resources={"GPU": 1}, silence_logs=quiet
            ) as plain_gpu,
            Client(plain_s.address, asynchronous=True) as plain,
        ):
            await plain.wait_for_workers(1)
            await accelsched.register(c)  # type: ignore[misc]  # defaults, as users run it

            async def verified() -> list:
                return await _events(c, "gpu-verified")

            await _until(verified, 30, "gpu-verified")
            clients = {
                "plain": (plain, plain_gpu.worker_address),
                "accelsched": (c, gpu.worker_address),
            }
            for name, (client, gpu_worker) in clients.items():
                await client.submit(make_context, fake, resources={"GPU": 1}, pure=False)
                await _timed_batch(client, gpu_worker, gpu_tiny_task, n, f"{name}-warm")
            out["cluster_tasks"] = await _paired(clients, n, rounds)

        # a leak: detection latency, then the lossless restart and the worker's return,
        # with checks ten times the default's pace (the plugins registered again)
        await c.unregister_worker_plugin(accelsched.GuardPlugin.name)
        await c.unregister_scheduler_plugin(accelsched.PlacementPlugin.name)
        await accelsched.register(  # type: ignore[misc]
            c, check_interval="100ms", leak_threshold="256MiB", leak_confirmations=2
        )

        async def fast() -> bool:
            return all((await c.run(_guard_interval, workers=[gpu.worker_address])).values())

        await _until(fast, 30, "the guard checking every 100 ms")
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
