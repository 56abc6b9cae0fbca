"""What the benchmarks share: simulated-GPU clusters, waiting on events, spreads.

The benchmarks measure accelsched the way a user's cluster would run it: nanny workers in
their own processes, each owning one simulated GPU of ``accelsched.testing.fake_gpus``,
and the unmodified ``pynvml`` reading device memory from the benchmark's own process (as
``nvidia-smi`` would from a shell on the GPU host: :mod:`benchmarks.harness.sampling`).
Nothing here is timed by a test.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import dask
from distributed import Client, Nanny, Scheduler, SpecCluster

from accelsched import internals

MiB = 2**20
GiB = 2**30

#: Restarting a worker every few seconds trips SpecCluster's lost-worker timer (it closes a
#: nanny for good when no worker of its name is registered as the timer fires); the
#: benchmarks restart far more often than a real cluster, so they push the timer out.
CLUSTER_CONFIG = {"distributed.deploy.lost-worker-timeout": "1h"}


def gpu_cluster(n: int = 2, resources: bool = False, **worker_options: Any) -> SpecCluster:
    """``n`` nanny workers named ``gpu-0``.. with one simulated GPU each (CUDA_VISIBLE_DEVICES).

    ``resources`` declares ``GPU=1`` on each (plain distributed needs the declaration to
    place annotated tasks; accelsched advertises verified GPUs without it).
    """
    options: dict[str, Any] = {"nthreads": 1, "silence_logs": 50, **worker_options}
    if resources:
        options["resources"] = {"GPU": 1}
    workers = {
        f"gpu-{i}": {
            "cls": Nanny,
            "options": {**options, "env": {"CUDA_VISIBLE_DEVICES": str(i)}},
        }
        for i in range(n)
    }
    dask.config.set(CLUSTER_CONFIG)  # read when a worker leaves: for the whole process
    return SpecCluster(
        workers=workers,
        scheduler={"cls": Scheduler, "options": {"dashboard_address": ":0"}},
        silence_logs=50,
    )


def settled(client: Client, n: int, quiet: float = 1.0, timeout: float = 60) -> None:
    """Return once ``n`` workers have run with their GPUs placed (:func:`gpus_ready`) for
    ``quiet`` seconds on end: a restart the last leak asked for (confirmed a few checks
    after its task) has finished. Closing the cluster over a worker still starting makes
    its guard report to a closing scheduler (``refused accelsched_offer``) through a
    closed connection pool (``Task exception was never retrieved``): noise, and a
    shutdown no user's cluster goes through."""
    deadline = time.monotonic() + timeout
    since = time.monotonic()
    while time.monotonic() - since < quiet:
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout} s waiting for {n} workers to settle")
        if not gpus_ready(client, n):
            since = time.monotonic()
        time.sleep(0.05)


def wait(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    """Poll ``predicate`` until it returns something truthy; TimeoutError naming ``what``."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.01)
    return value


def events(
    client: Client, action: str, since: float = 0, topic: str = "accelsched"
) -> list[tuple[float, dict]]:
    """Events of one action logged at or after ``since`` (wall-clock seconds)."""
    return [(t, m) for t, m in client.get_events(topic) if m["action"] == action and t >= since]


def _gpu_counts(dask_scheduler: Any) -> list[float]:
    return [w.resources.get("GPU", 0) for w in dask_scheduler.running]


def gpus_ready(client: Client, n: int) -> bool:
    """All ``n`` workers are running with one GPU placed against each."""
    counts = client.run_on_scheduler(_gpu_counts)
    return len(counts) == n and all(c == 1 for c in counts)


def until_empty(client: Client, tail: float) -> bool:
    """Whether the cluster gave back all its workers within ``tail`` seconds."""
    deadline = time.monotonic() + tail
    while (listed := internals.workers_listed(client)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not listed
