"""Leak guard figures on simulated GPUs: detection latency and restart-to-ready.

Two nanny workers, each owning one simulated 16 GiB GPU (``accelsched.testing``), the
guard checking every ``--interval`` with a 256 MiB threshold and 2 confirmations.

- **Leak trials**: a GPU task leaks 512 MiB on one worker. Measured from events: checks
  above the threshold before the ``leak`` event, seconds from the leaking task's end to
  the ``leak`` event, seconds from the ``leak`` event (the restart request) to the
  ``restart`` event, and to the restarted worker's GPUs being verified again (ready).

False positives on benign workloads are measured by ``bench_detection``. Run with
``python -m benchmarks guard`` (``--quick``: 1 trial), or alone:
``python -m benchmarks.bench_guard [--trials 5] [--interval 100ms] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path
from typing import Any

import dask
from dask.utils import parse_timedelta
from distributed import Client, Nanny, Scheduler, SpecCluster

import accelsched
from accelsched.testing import device_alloc, fake_gpus
from benchmarks.plots import bars

NAME = "guard"

MiB = 2**20
GiB = 2**30


def leaky(i: int) -> float:
    device_alloc(512 * MiB, leak=True)
    return time.time()


def events(client: Client, action: str, since: float = 0) -> list[tuple[float, dict]]:
    return [
        (t, m) for t, m in client.get_events("accelsched") if m["action"] == action and t >= since
    ]


def wait(predicate: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.01)
    return value


def cluster() -> SpecCluster:
    def nanny(cvd: str) -> dict:
        return {
            "cls": Nanny,
            "options": {"nthreads": 1, "env": {"CUDA_VISIBLE_DEVICES": cvd}, "silence_logs": 50},
        }

    return SpecCluster(
        workers={"a": nanny("0"), "b": nanny("1")},
        scheduler={"cls": Scheduler, "options": {"dashboard_address": ":0"}},
        silence_logs=50,
    )


def ready(client: Client, n: int) -> bool:
    res = client.run_on_scheduler(
        lambda dask_scheduler: [w.resources.get("GPU", 0) for w in dask_scheduler.workers.values()]
    )
    return len(res) == n and all(r == 1 for r in res)


def leak_trial(client: Client) -> dict[str, float]:
    since = time.time()
    target = sorted(client.scheduler_info(n_workers=-1)["workers"])[0]
    with dask.annotate(resources={"GPU": 1}):
        ended = client.submit(leaky, since, workers=[target], pure=False).result()
    ((t_leak, leak),) = wait(lambda: events(client, "leak", since), 30, "leak event")
    ((t_restart, restart),) = wait(lambda: events(client, "restart", since), 60, "restart event")
    wait(lambda: ready(client, 2) and events(client, "gpu-verified", t_restart), 60, "ready")
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


def trials(n: int, interval: str) -> list[dict[str, float]]:
    """``n`` leak trials on a fresh two-worker cluster."""
    with fake_gpus(count=2, memory="16GiB"), cluster() as c, Client(c) as client:
        accelsched.register(
            client,
            check_interval=interval,
            leak_threshold="256MiB",
            leak_confirmations=2,
            max_restarts=n + 1,
        )
        wait(lambda: ready(client, 2), 30, "verified GPUs")
        return [leak_trial(client) for _ in range(n)]


def run(quick: bool, out: Path) -> dict[str, Any]:
    """The runner's entry point (``python -m benchmarks guard``)."""
    logging.getLogger("distributed").setLevel(logging.ERROR)
    results = trials(1 if quick else 5, "100ms")
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


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--interval", default="100ms")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    logging.getLogger("distributed").setLevel(logging.ERROR)
    interval = parse_timedelta(args.interval)
    results = trials(args.trials, args.interval)
    print(
        f"simulated GPUs (accelsched.testing), check interval {interval * 1000:.0f} ms, "
        f"threshold 256 MiB, 2 confirmations, {args.trials} leak trials"
    )
    for field in FIELDS:
        values = [t[field] for t in results]
        print(
            f"  {field:<24} median {statistics.median(values):7.3f}  "
            f"min {min(values):7.3f}  max {max(values):7.3f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"interval_s": interval, "trials": results}, f, indent=2)


if __name__ == "__main__":
    main()
