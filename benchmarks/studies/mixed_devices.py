"""Mixed devices: placement by declared memory against one task per GPU, on 80 and 40 GiB GPUs.

Two nanny workers, one simulated device each: an 80 GiB H100 and a 40 GiB A100 (through
the real pynvml over the fake NVML), eight threads each. The workload: many small tasks
(4 GiB each) and a few large ones (60 GiB), every task allocating its memory on the
device it runs on (``device_alloc``, seen by NVML like CuPy's) for a fixed time. Three
ways to run it, in alternating order for ``rounds`` rounds, fresh clusters each:

- ``plain``: distributed alone, ``resources={"GPU": 1}`` per task, declared ``GPU=1`` on
  each worker; a task allocates on the worker's device.
- ``count``: accelsched with count-only steps (``@gpu``): verified, bound, one task per GPU.
- ``memory``: accelsched with ``@gpu(memory=...)``: a large task only where a device is
  large enough, small ones packed side by side while their declared needs fit.

Figures per way: tasks finished, OOM failures, throughput (tasks/s), and the device
memory the tasks held (the time-weighted mean of their declared bytes, over both devices'
memory). Run with ``python -m benchmarks mixed_devices`` (``--quick``: fewer tasks, one
round).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import dask
from distributed import Client, Nanny, Scheduler, SpecCluster

import accelsched
from accelsched.testing import OutOfDeviceMemory, device_alloc, fake_gpus
from benchmarks.harness.clusters import GiB, wait
from benchmarks.harness.plots import bars
from benchmarks.harness.results import spread

NAME = "mixed_devices"
SMALL, LARGE = 4 * GiB, 60 * GiB
DEVICES = {"NVIDIA H100 80GB HBM3": 80 * GiB, "NVIDIA A100-SXM4-40GB": 40 * GiB}
THREADS = 8


def _hold(nbytes: int, seconds: float) -> tuple[float, float, int]:
    """Allocate ``nbytes`` on the task's device for ``seconds``; (start, end, bytes)."""
    device = accelsched.current_device()
    start = time.time()
    buf = device_alloc(nbytes, device=0 if device is None else device)
    time.sleep(seconds)
    del buf
    return start, time.time(), nbytes


def plain_task(nbytes: int, seconds: float) -> tuple[float, float, int]:
    return _hold(nbytes, seconds)


count_task = accelsched.gpu(_hold)
small_task = accelsched.gpu(memory=SMALL)(_hold)
large_task = accelsched.gpu(memory=LARGE)(_hold)


def _cluster(resources: bool) -> SpecCluster:
    options: dict[str, Any] = {"nthreads": THREADS, "silence_logs": 50}
    if resources:
        options["resources"] = {"GPU": 1}
    workers = {
        f"gpu-{i}": {"cls": Nanny, "options": {**options, "env": {"CUDA_VISIBLE_DEVICES": str(i)}}}
        for i in range(2)
    }
    return SpecCluster(
        workers=workers,
        scheduler={"cls": Scheduler, "options": {"dashboard_address": ":0"}},
        silence_logs=50,
    )


def _verified(client: Client) -> bool:
    counts = client.run_on_scheduler(
        lambda dask_scheduler: [w.resources.get("GPU", 0) for w in dask_scheduler.running]
    )
    return len(counts) == 2 and all(c == 1 for c in counts)


def one_run(way: str, sizes: list[int], seconds: float) -> dict[str, Any]:
    """Run the workload one way on a fresh cluster; its figures."""
    with _cluster(resources=way == "plain") as cluster, Client(cluster) as client:
        if way != "plain":
            accelsched.register(client, check_interval="1h", fast_restart=False)
            wait(lambda: _verified(client), 60, "two verified GPUs")
        else:
            client.wait_for_workers(2)
        start = time.time()
        if way == "plain":
            with dask.annotate(resources={"GPU": 1}):
                futures = [client.submit(plain_task, n, seconds, pure=False) for n in sizes]
        elif way == "count":
            futures = [client.submit(count_task, n, seconds, pure=False) for n in sizes]
        else:
            futures = [
                client.submit(large_task if n == LARGE else small_task, n, seconds, pure=False)
                for n in sizes
            ]
        done, oom, other, spans = 0, 0, 0, []
        for f in futures:
            try:
                spans.append(f.result())
                done += 1
            except OutOfDeviceMemory:
                oom += 1
            except Exception:
                other += 1
        wall = time.time() - start
    held = sum((end - st) * n for st, end, n in spans)
    return {
        "way": way,
        "tasks": len(sizes),
        "finished": done,
        "oom_failed": oom,
        "other_failed": other,
        "seconds": wall,
        "throughput": done / wall if wall else 0.0,
        "memory_use": held / (wall * sum(DEVICES.values())) if wall else 0.0,
    }


def run(quick: bool, out: Path) -> dict[str, Any]:
    small, large, rounds, seconds = (24, 2, 1, 0.3) if quick else (96, 4, 5, 0.5)
    # the large tasks among the small ones, evenly: each way sees the same order
    sizes = [SMALL] * small
    for i in range(large):
        sizes.insert((i + 1) * len(sizes) // (large + 1), LARGE)
    ways = ["plain", "count", "memory"]
    runs: dict[str, list[dict[str, Any]]] = {w: [] for w in ways}
    with fake_gpus(
        2,
        list(DEVICES.values()),
        names=list(DEVICES),
        capability=["9.0", "8.0"],
        context_memory="256MiB",
    ):
        for r in range(rounds):
            order = ways if r % 2 == 0 else ways[::-1]
            for way in order:
                runs[way].append(one_run(way, sizes, seconds))
    summary = {
        way: {
            "throughput": spread(x["throughput"] for x in rs),
            "oom_failed": spread(x["oom_failed"] for x in rs),
            "other_failed": spread(x["other_failed"] for x in rs),
            "memory_use": spread(x["memory_use"] for x in rs),
        }
        for way, rs in runs.items()
    }
    per_gpu = summary["plain"]["throughput"]["median"]
    memory = summary["memory"]
    targets = {
        "throughput_vs_one_task_per_gpu": memory["throughput"]["median"] / per_gpu
        if per_gpu
        else float("inf"),
        "no_oom_with_requirements": memory["oom_failed"]["max"] == 0,
        "count_only_has_oom": summary["count"]["oom_failed"]["min"] > 0,
    }
    targets["throughput_met"] = targets["throughput_vs_one_task_per_gpu"] >= 2
    bars(
        out / f"{NAME}_throughput.png",
        {w: summary[w]["throughput"]["median"] for w in ways},
        ylabel="tasks / s (median)",
        title=f"{small} x 4 GiB + {large} x 60 GiB tasks on 80 + 40 GiB GPUs",
    )
    bars(
        out / f"{NAME}_oom.png",
        {w: summary[w]["oom_failed"]["median"] for w in ways},
        ylabel="OOM failures (median)",
        title="tasks that ran out of device memory",
    )
    return {
        "setup": {
            "small": small,
            "large": large,
            "rounds": rounds,
            "task_seconds": seconds,
            "threads_per_worker": THREADS,
            "devices": {k: v // GiB for k, v in DEVICES.items()},
        },
        "runs": runs,
        "summary": summary,
        "targets": targets,
    }
