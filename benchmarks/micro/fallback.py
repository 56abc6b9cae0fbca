"""Fallback latency: how long a GPU task waits before its CPU form runs, vs its timeout.

Runs a GPU-less local cluster (two worker processes, no GPUs) with the PlacementPlugin
and submits GPU-annotated tasks with several ``fallback_timeout`` values, then a chain of
six GPU tasks. Figures come from the ``fallback`` events (``waited``) and from wall time
on the client. Run with ``python -m benchmarks fallback`` (``--quick``: one run per
timeout, timeouts 0 and 0.25 s, the chain's 0.25 s).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import dask
from distributed import Client, LocalCluster

import accelsched
from benchmarks.harness.plots import lines

NAME = "fallback"
TIMEOUTS = [0, 0.25, 0.5, 1.0, 2.0]


def cpu_or_gpu(i: int) -> str:
    return "gpu" if accelsched.current_device() is not None else "cpu"


def inc(x: int) -> int:
    return x + 1


def measure(client: Client, timeout: float, repeat: int) -> dict[str, Any]:
    walls, waits = [], []
    for r in range(repeat):
        key = f"t{timeout}-{r}-{time.monotonic_ns()}"
        start = time.monotonic()
        with dask.annotate(resources={"GPU": 1}, fallback_timeout=timeout):
            assert client.submit(cpu_or_gpu, r, key=key).result() == "cpu"
        walls.append(time.monotonic() - start)
        (event,) = [m for _, m in client.get_events("accelsched") if m.get("key") == key]
        waits.append(event["waited"])
    return {
        "timeout_s": timeout,
        "waited_median_s": statistics.median(waits),
        "waited_max_s": max(waits),
        "wall_median_s": statistics.median(walls),
        "overshoot_median_ms": (statistics.median(waits) - timeout) * 1000,
    }


def chain(client: Client, length: int = 6, timeout: float = 1.0) -> dict[str, Any]:
    start = time.monotonic()
    with dask.annotate(resources={"GPU": 1}, fallback_timeout=timeout):
        fut = client.submit(inc, 0, key=f"chain-0-{start}")
        for i in range(1, length):
            fut = client.submit(inc, fut, key=f"chain-{i}-{start}")
    assert fut.result() == length
    return {"length": length, "timeout_s": timeout, "wall_s": time.monotonic() - start}


def measure_all(
    repeat: int, timeouts: list[float], chain_timeout: float = 1.0
) -> tuple[list[dict[str, Any]], dict]:
    with (
        LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0"
        ) as cluster,
        Client(cluster) as client,
    ):
        accelsched.register(client)  # default interval: fallback-interval 250ms
        rows = [measure(client, t, repeat) for t in timeouts]
        chained = chain(client, timeout=chain_timeout)
    return rows, chained


def run(quick: bool, out: Path) -> dict[str, Any]:
    """The runner's entry point (``python -m benchmarks fallback``)."""
    if quick:
        rows, chained = measure_all(1, TIMEOUTS[:2], chain_timeout=TIMEOUTS[1])
    else:
        rows, chained = measure_all(5, TIMEOUTS)
    lines(
        out / f"{NAME}.png",
        [r["timeout_s"] for r in rows],
        {
            "waited (median)": [r["waited_median_s"] for r in rows],
            "submit to result (median)": [r["wall_median_s"] for r in rows],
            "the timeout": [r["timeout_s"] for r in rows],
        },
        xlabel="fallback_timeout (s)",
        ylabel="seconds",
        title="GPU task on a GPU-less cluster: time to its CPU form",
    )
    return {"single": rows, "chain": chained}
