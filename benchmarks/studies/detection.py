"""Detection quality: leak size against the threshold, attribution, false positives.

Two nanny workers with one simulated 16 GiB GPU each; the guard checks every 100 ms with
a 256 MiB threshold, 2 confirmations, and pool freeing off (so pool caches stay, as
between frees). Two parts:

- **Sweep**: for leak sizes from 0.25x to 4x the threshold, a marked step ``leaky``
  leaks that size once per round on ``gpu-0`` between three ``clean`` steps (64 MiB
  temporaries back to the pool), until the ``leak`` event. Figures: leaking runs until
  detection, bytes leaked at detection, checks from the crossing run's end to the event
  (time / interval), and whether the event's first prefix is ``leaky``.
- **Benign workloads** on ``gpu-1``, each held for a few seconds of checks: large device
  results held, pool caches, an RMM-style fixed pool, many small results, cudf-like
  opaque results. Figure: ``leak`` events (false positives); plot: the device memory NVML
  showed meanwhile, against what a naive "used above threshold" rule would flag.

Run with ``python -m benchmarks detection`` (``--quick``: sizes 0.5x and 2x, 0.3 s
(three checks) per benign workload).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import dask
from distributed import Client

import accelsched
from accelsched.testing import fake_gpus
from benchmarks.harness.clusters import MiB, events, gpu_cluster, gpus_ready, wait
from benchmarks.harness.plots import lines, memory_panels
from benchmarks.harness.sampling import MemorySampler
from benchmarks.studies import workload

NAME = "detection"
THRESHOLD = 256 * MiB
INTERVAL = 0.1
CONTEXT = 64 * MiB
FACTORS = (0.25, 0.5, 1.0, 1.5, 2.0, 4.0)
#: In this order, on one worker: the RMM-style pool stays reserved once made, so the last
#: workload's opaque results are allocated inside it.
BENIGN = {
    "large results held (4 x 1 GiB)": (workload.big_result, 4),
    "pool caching, no freeing (4 GiB cached)": (workload.cached_temporaries, 4),
    "cudf-like opaque results (4 x 1 GiB)": (workload.opaque_result, 4),
    "many small results (200 x 8 MiB)": (workload.small_results, 200),
    "RMM-style fixed pool (4 GiB)": (workload.rmm_style, 2),
    "cudf-like opaque results inside the RMM-style pool": (workload.opaque_result, 4),
}


def _gpu(client: Client, fn: Any, *args: Any, worker: str) -> Any:
    with dask.annotate(resources={"GPU": 1}):
        return client.submit(fn, *args, workers=[worker], pure=False)


def sweep_one(client: Client, factor: float) -> dict[str, Any]:
    """Leak ``factor`` x threshold per round on gpu-0 until the leak event."""
    nbytes = int(factor * THRESHOLD)
    since = time.time()
    found = None
    runs = 0
    ended = 0.0
    while found is None and runs < int(1 / factor) + 3:
        runs += 1
        futures = [_gpu(client, workload.clean, i, worker="gpu-0") for i in range(3)]
        futures.insert(1, _gpu(client, workload.leaky, nbytes, worker="gpu-0"))
        client.gather(futures)
        ended = time.time()
        del futures
        deadline = time.monotonic() + 8 * INTERVAL
        while found is None and time.monotonic() < deadline:
            found = next(iter(events(client, "leak", since)), None)
            time.sleep(0.01)
    out: dict[str, Any] = {"factor": factor, "leak_bytes": nbytes, "runs": runs}
    if found is None:
        return {**out, "detected": False}
    t, leak = found
    wait(lambda: events(client, "restart", since), 60, "restart")
    wait(lambda: gpus_ready(client, 2), 60, "ready after restart")
    return {
        **out,
        "detected": True,
        "leaked_at_detection": runs * nbytes,
        "estimate": leak["nbytes"],
        "checks_after_crossing": (t - ended) / INTERVAL,
        "first_prefix": leak["prefixes"][0] if leak["prefixes"] else None,
        "right_prefix_first": bool(leak["prefixes"]) and leak["prefixes"][0] == "leaky",
    }


def benign(client: Client, seconds: float) -> tuple[dict[str, int], dict[str, Any]]:
    """False positives per benign workload on gpu-1, and NVML traces of each."""
    counts, traces = {}, {}
    for name, (fn, n) in BENIGN.items():
        since = time.time()
        with MemorySampler() as trace:
            with dask.annotate(resources={"GPU": 1}):
                held = client.map(fn, range(n), workers=["gpu-1"], pure=False)
                client.gather(held)
            time.sleep(seconds)
            found = events(client, "leak", since)
            counts[name] = len(found)
            if found:
                print(f"  {name}: {found}", flush=True)
            del held
            time.sleep(0.3)
        traces[name] = {"used": {"1": trace.used.get(1, [])}, "ended": {}}
    return counts, traces


def run(quick: bool, out: Path) -> dict[str, Any]:
    """The runner's entry point (``python -m benchmarks detection``)."""
    logging.getLogger("distributed").setLevel(logging.ERROR)
    factors = (0.5, 2.0) if quick else FACTORS
    seconds = 0.3 if quick else 3.0
    gpus = fake_gpus(count=2, memory="16GiB", context_memory=CONTEXT)
    with gpus, gpu_cluster() as cluster, Client(cluster) as client:
        accelsched.register(
            client,
            check_interval=INTERVAL,
            leak_threshold=THRESHOLD,
            leak_confirmations=2,
            free_pools_every=0,  # keep the pools' caches: a benign workload needs them
            max_restarts=10_000,
        )
        wait(lambda: gpus_ready(client, 2), 60, "verified GPUs")
        false_positives, traces = benign(client, seconds)  # before any restart
        sweep = [sweep_one(client, f) for f in factors]
    detected = [s for s in sweep if s["detected"]]
    lines(
        out / f"{NAME}_sweep.png",
        [s["factor"] for s in detected],
        {
            "leaked at detection / threshold": [
                s["leaked_at_detection"] / THRESHOLD for s in detected
            ],
            "bound: 1 + leak / threshold": [1 + s["factor"] for s in detected],
            "checks after the crossing run": [s["checks_after_crossing"] for s in detected],
        },
        xlabel="leak size / threshold (one leak per round)",
        ylabel="ratio / checks",
        title="Detection vs leak size (threshold 256 MiB, 2 confirmations, 100 ms checks)",
        logx=True,
    )
    memory_panels(
        out / f"{NAME}_benign.png",
        traces,
        total=16 * 2**30,
        limit=CONTEXT + THRESHOLD,
        title="Benign workloads: NVML used memory (GPU 1) vs context + threshold (dotted); "
        "leak events: " + ", ".join(str(n) for n in false_positives.values()),
    )
    return {
        "threshold": THRESHOLD,
        "interval_s": INTERVAL,
        "sweep": sweep,
        "false_positives": false_positives,
        "attribution_right": sum(s.get("right_prefix_first", False) for s in sweep),
        "attribution_runs": len(detected),
    }
