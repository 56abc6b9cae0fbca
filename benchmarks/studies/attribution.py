"""Leak attribution on simulated GPUs: does the ``leak`` event name the step that leaked?

A pipeline of five GPU step types (``@accelsched.gpu``) over 8 blocks; in each run one
step type, chosen in turn, leaks 320 MiB on one block. Every step also uses device
memory the way real steps do (temporaries returned to the pool), so the other four leave
pool cache behind, not leaks. Two nanny workers with one simulated 16 GiB GPU each; the
guard checks every 100 ms with a 256 MiB threshold. A run counts as right when the first
prefix of its ``leak`` event is the leaking step. Both graph shapes are run: fused (dask's
default: all five steps in one task per block, measured step by step inside it) and
unfused (one task per step).

Run with ``python -m benchmarks attribution`` (``--quick``: 1 run per graph shape).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dask
import dask.array as da
import numpy as np
from distributed import Client, Nanny, Scheduler, SpecCluster

import accelsched
from accelsched import internals
from accelsched.testing import device_alloc, fake_gpus
from benchmarks.harness.plots import bars

NAME = "attribution"
MiB = 2**20
STEPS = ["load", "clean", "scale", "join", "total"]


def _work(block: np.ndarray, stage: int, leaks: bool) -> np.ndarray:
    device_alloc(64 * MiB)  # a temporary: back to the pool when the step returns
    if leaks and block[0, 0] == stage:  # block 0 (each stage adds 1): one leak a run
        device_alloc(320 * MiB, leak=True)
    return block + 1


def _step(name: str) -> Any:
    stage = STEPS.index(name)

    def step(block: np.ndarray, leaky: str = "") -> np.ndarray:
        return _work(block, stage, leaks=leaky == name)

    step.__name__ = step.__qualname__ = name
    return accelsched.gpu(step)


load, clean, scale, join, total = (_step(name) for name in STEPS)


def pipeline(leaky: str) -> da.Array:
    x = da.arange(8 * 4 * 4, chunks=16).reshape((32, 4)).rechunk((4, 4)).astype("f8")
    x = x - x.min()  # block 0 starts at 0
    for step in (load, clean, scale, join, total):
        x = x.map_blocks(step, leaky=leaky, dtype="f8")
    return x.sum()


def _ready(dask_scheduler: Any) -> int:
    """Workers running with their GPU verified and placed."""
    return sum(1 for w in dask_scheduler.running if w.resources.get("GPU", 0) >= 1)


def _state(dask_scheduler: Any) -> Any:
    from collections import Counter

    return (
        Counter(ts.state for ts in dask_scheduler.tasks.values()),
        {
            a: (str(w.status), dict(w.resources), len(w.processing))
            for a, w in dask_scheduler.workers.items()
        },
        [str(w.address) for w in dask_scheduler.running],
    )


def attribution_runs(runs: int, fused: bool, client: Client, first: int = 0) -> dict[str, Any]:
    right = 0
    named: list[tuple[str, list[str]]] = []
    for i in range(first, first + runs):
        leaky = STEPS[i % len(STEPS)]
        since = time.time()
        with dask.config.set({"optimization.fuse.active": None if fused else False}):
            try:
                client.compute(pipeline(leaky)).result(timeout=60)
            except TimeoutError:
                for _, m in client.get_events("accelsched")[-12:]:
                    print("   ", accelsched.events.describe(m))
                print(client.run_on_scheduler(_state))
                raise
        deadline = time.monotonic() + 30
        leak = None
        while leak is None and time.monotonic() < deadline:
            leaks = [m for t, m in client.get_events("accelsched") if t >= since]
            leak = next((m for m in leaks if m["action"] == "leak"), None)
            time.sleep(0.05)
        prefixes = list(leak["prefixes"]) if leak else []
        named.append((leaky, prefixes))
        print(
            f"  run {i + 1}: leaked in {leaky}, named {prefixes} ({time.time() - since:.1f}s)",
            flush=True,
        )
        right += bool(prefixes) and prefixes[0] == leaky
        # the next run starts once the restart is over: both workers running, verified
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            restarted = any(
                m["action"] == "restart" for t, m in client.get_events("accelsched") if t >= since
            )
            if restarted and client.run_on_scheduler(_ready) == 2:
                break
            time.sleep(0.05)
        if i < first + runs - 1:  # the cluster goes after its last run: nothing to space
            time.sleep(2.0)  # restarts well apart: this measures attribution, not restart storms
    return {"runs": runs, "right": right, "named": named}


def both_shapes(runs: int, per_cluster: int) -> dict[str, Any]:
    """``runs`` runs of each graph shape, a fresh cluster every ``per_cluster`` runs."""
    logging.getLogger("distributed").setLevel(logging.ERROR)
    out: dict[str, Any] = {}
    with fake_gpus(count=2, memory="16GiB"):
        for fused in (True, False):
            label = "fused" if fused else "unfused"
            total: dict[str, Any] = {"runs": 0, "right": 0, "named": []}
            done = 0
            while done < runs:
                batch = min(per_cluster, runs - done)
                with _cluster() as client:
                    r = attribution_runs(batch, fused, client, first=done)
                for k in ("runs", "right"):
                    total[k] += r[k]
                total["named"] += r["named"]
                done += batch
            out[label] = total
    return out


def run(quick: bool, out: Path) -> dict[str, Any]:
    """The runner's entry point (``python -m benchmarks attribution``)."""
    figures = both_shapes(1 if quick else 20, 5)
    bars(
        out / f"{NAME}.png",
        {f"{k}: right of {v['runs']}": v["right"] for k, v in figures.items()},
        ylabel="leaking step named first",
        title="Leak attribution, five step types",
        ymax=max(v["runs"] for v in figures.values()) * 1.15,
    )
    return figures


@contextlib.contextmanager
def _cluster() -> Iterator[Client]:
    """A fresh cluster for a few runs (each run restarts a worker)."""
    workers = {
        f"gpu-{i}": {
            "cls": Nanny,
            "options": {
                "nthreads": 1,
                "env": {"CUDA_VISIBLE_DEVICES": str(i)},
                "silence_logs": logging.ERROR,  # the worker processes' own logging
            },
        }
        for i in range(2)
    }
    scheduler = {"cls": Scheduler, "options": {"dashboard_address": ":0"}}
    with (
        SpecCluster(workers=workers, scheduler=scheduler, silence_logs=logging.ERROR) as cl,
        Client(cl) as client,
    ):
        accelsched.register(
            client,
            check_interval="100ms",
            leak_threshold="256MiB",
            leak_confirmations=2,
            max_restarts=1000,
        )
        client.wait_for_workers(2)
        while client.run_on_scheduler(_ready) < 2:
            time.sleep(0.05)
        # a first GPU task on each worker: its CUDA context, as any real GPU work makes
        warm = accelsched.gpu(lambda: device_alloc(MiB) and None)
        addrs = list(internals.workers_listed(client))
        client.gather([client.submit(warm, workers=[w], pure=False) for w in addrs])
        yield client
