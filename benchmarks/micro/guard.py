"""Leak guard figures on simulated GPUs: detection latency and restart-to-ready.

Two nanny workers, each owning one simulated 16 GiB GPU (``accelsched.testing``), the
guard checking every 100 ms with a 256 MiB threshold and 2 confirmations.

- **Leak trials**: a GPU task leaks 512 MiB on one worker. Measured from events: checks
  above the threshold before the ``leak`` event, seconds from the leaking task's end to
  the ``leak`` event, seconds from the ``leak`` event (the restart request) to the
  ``restart`` event, and to the restarted worker's GPUs being verified again (ready).

False positives on benign workloads are measured by the ``detection`` study. Run with
``python -m benchmarks guard [--trials 5]`` (``--quick``: 1 trial).
"""

from __future__ import annotations

import logging
import statistics
import time
from pathlib import Path
from typing import Any

import dask
from distributed import Client

import accelsched
from accelsched import internals
from accelsched.testing import device_alloc, fake_gpus
from benchmarks.harness.clusters import MiB, events, gpu_cluster, gpus_ready, wait
from benchmarks.harness.plots import bars

NAME = "guard"
TRIALS, QUICK_TRIALS = 5, 1
INTERVAL = "100ms"


def leaky(i: int) -> float:
    device_alloc(512 * MiB, leak=True)
    return time.time()


def leak_trial(client: Client) -> dict[str, float]:
    since = time.time()
    target = sorted(internals.workers_listed(client))[0]
    with dask.annotate(resources={"GPU": 1}):
        ended = client.submit(leaky, since, workers=[target], pure=False).result()
    ((t_leak, leak),) = wait(lambda: events(client, "leak", since), 30, "leak event")
    ((t_restart, restart),) = wait(lambda: events(client, "restart", since), 60, "restart event")
    wait(lambda: gpus_ready(client, 2) and events(client, "gpu-verified", t_restart), 60, "ready")
    t_ready = events(client, "gpu-verified", t_restart)[-1][0]
    assert leak["worker"] == target == restart["worker"]
    return {
        "checks_above_threshold": leak["checks"],
        "detect_s": t_leak - ended,
        "request_to_restart_s": t_restart - t_leak,
        "restart_to_ready_s": t_ready - t_restart,
        "request_to_ready_s": t_ready - t_leak,
        "moved_keys": restart["moved"],
    }


FIELDS = (
    "checks_above_threshold",
    "detect_s",
    "request_to_restart_s",
    "restart_to_ready_s",
    "request_to_ready_s",
    "moved_keys",
)


def leak_trials(n: int, interval: str) -> list[dict[str, float]]:
    """``n`` leak trials on a fresh two-worker cluster."""
    with fake_gpus(count=2, memory="16GiB"), gpu_cluster() as c, Client(c) as client:
        accelsched.register(
            client,
            check_interval=interval,
            leak_threshold="256MiB",
            leak_confirmations=2,
            max_restarts=n + 1,
        )
        wait(lambda: gpus_ready(client, 2), 30, "verified GPUs")
        return [leak_trial(client) for _ in range(n)]


def run(quick: bool, out: Path, trials: int | None = None) -> dict[str, Any]:
    """``trials`` leak trials (``--trials``; default 5, 1 with ``--quick``)."""
    logging.getLogger("distributed").setLevel(logging.ERROR)
    n = trials if trials is not None else QUICK_TRIALS if quick else TRIALS
    results = leak_trials(n, INTERVAL)
    steps = ("detect_s", "request_to_restart_s", "restart_to_ready_s")
    bars(
        out / f"{NAME}.png",
        {s.removesuffix("_s"): statistics.median(t[s] for t in results) for s in steps},
        ylabel="seconds (median)",
        title="Leaking task's end to the restarted worker's GPUs verified",
    )
    return {
        "interval_s": 0.1,
        "trials": results,
        "median": {f: statistics.median(t[f] for t in results) for f in FIELDS},
    }
