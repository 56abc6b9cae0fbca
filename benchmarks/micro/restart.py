"""Restart request → ready: a leaking worker replaced by a spawned or a forked process.

Two nanny workers, one simulated 16 GiB GPU each; ``check_interval=100ms``,
``leak_threshold=256MiB``, 2 confirmations. A GPU task leaks 512 MiB on one worker; the
figure is the time from the ``leak`` event (the guard's restart request, logged by the
scheduler) to the ``gpu-verified`` event of the worker's new process (ready for GPU
tasks), read from the scheduler's event log. Each trial is made twice: with the worker
holding nothing, and holding ``HELD`` small results (moved to its peer first).

Two arms, in paired rounds (their order alternating; a fresh cluster per arm and round,
one warm-up restart each, so that the measured restart replaces a process of the arm's
own kind):

- **before**: ``fast_restart=False`` (the nanny spawns a new interpreter) and the
  retirement awaited until distributed's ``retire_workers`` returns (its poll: every
  ``len(keys) / 400`` s, up to 0.5 s);
- **after**: ``fast_restart=True`` (forked from a warm server) and the retirement
  watched every 10 ms (:mod:`accelsched.internals.scheduler`).

Run with ``python -m benchmarks restart`` (``--quick``: one round, 20 results held).
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from pathlib import Path
from typing import Any

import dask
from distributed import Client

import accelsched
from accelsched.internals import scheduler as restarting
from accelsched.testing import device_alloc, fake_gpus
from benchmarks.harness.clusters import MiB, events, gpu_cluster, gpus_ready, wait
from benchmarks.harness.plots import bars
from benchmarks.harness.results import spread

NAME = "restart"
ROUNDS, QUICK_ROUNDS = 6, 1
HELD, QUICK_HELD = 300, 20
ARMS = {"before": False, "after": True}  # arm -> fast (fast_restart and the retire watch)


def leaky(i: int) -> int:
    device_alloc(512 * MiB, leak=True)
    return i


def _worker_of(client: Client, name: str) -> str:
    return client.run_on_scheduler(
        lambda dask_scheduler: next(
            (w.address for w in dask_scheduler.running if w.name == name), ""
        )
    )


def trial(client: Client, held: int) -> dict[str, float]:
    """Leak on worker ``gpu-0`` (holding ``held`` results); seconds request → ready."""
    target = wait(lambda: _worker_of(client, "gpu-0"), 30, "gpu-0")
    kept = client.map(lambda i: i, range(held), workers=[target], pure=False) if held else []
    client.gather(kept)
    since = time.time()
    with dask.annotate(resources={"GPU": 1}):
        client.submit(leaky, 0, workers=[target], pure=False).result()
    ((t_leak, _),) = wait(lambda: events(client, "leak", since), 30, "leak event")
    ((t_restart, restart),) = wait(lambda: events(client, "restart", since), 60, "restart")

    def verified() -> list:
        new = _worker_of(client, "gpu-0")
        return [t for t, m in events(client, "gpu-verified", since) if m["worker"] == new]

    wait(lambda: new_address(client, target) and gpus_ready(client, 2) and verified(), 60, "ready")
    t_ready = verified()[-1]
    assert client.gather(kept) == list(range(held))  # nothing lost on the way
    del kept
    return {
        "request_to_ready_s": t_ready - t_leak,
        "request_to_restart_s": t_restart - t_leak,
        "restart_to_ready_s": t_ready - t_restart,
        "moved_keys": restart["moved"],
    }


def new_address(client: Client, old: str) -> bool:
    return _worker_of(client, "gpu-0") not in ("", old)


def arm(fast: bool, held: int) -> dict[str, dict[str, float]]:
    """One fresh cluster: a warm-up restart, then a trial holding nothing and one holding
    ``held`` results."""
    restarting.WATCH_RETIREMENT = fast
    try:
        with gpu_cluster() as cluster, Client(cluster) as client:
            accelsched.register(
                client,
                check_interval="100ms",
                leak_threshold="256MiB",
                leak_confirmations=2,
                max_restarts=100,
                fast_restart=fast,
            )
            wait(lambda: gpus_ready(client, 2), 60, "verified GPUs")
            trial(client, 0)  # warm-up: the measured restart replaces a process of its kind
            return {"empty": trial(client, 0), "holding": trial(client, held)}
    finally:
        restarting.WATCH_RETIREMENT = True


def run(quick: bool, out: Path) -> dict[str, Any]:
    """Paired rounds of both arms (order alternating)."""
    logging.getLogger("distributed").setLevel(logging.ERROR)
    rounds, held = (QUICK_ROUNDS, QUICK_HELD) if quick else (ROUNDS, HELD)
    load = [os.getloadavg()[0]]
    trials: dict[str, list[dict[str, Any]]] = {a: [] for a in ARMS}
    with fake_gpus(count=2, memory="16GiB"):
        for r in range(rounds):
            order = list(ARMS) if r % 2 == 0 else list(reversed(ARMS))
            for name in order:
                trials[name].append(arm(ARMS[name], held))
                print(f"  round {r + 1} {name}: {trials[name][-1]}", flush=True)
            load.append(os.getloadavg()[0])
    if quick:
        print(
            f"  quick run: not the README's figures ({QUICK_ROUNDS} round holding "
            f"{QUICK_HELD} results, against {ROUNDS} rounds holding {HELD}): a restart "
            "holding fewer results moves less, and one round has no spread",
            flush=True,
        )
    summary = {
        a: {
            kind: {
                f: spread(t[kind][f] for t in ts)
                for f in ("request_to_ready_s", "request_to_restart_s", "restart_to_ready_s")
            }
            for kind in ("empty", "holding")
        }
        for a, ts in trials.items()
    }
    ratios = {
        kind: spread(
            b[kind]["request_to_ready_s"] / a[kind]["request_to_ready_s"]
            for b, a in zip(trials["before"], trials["after"], strict=True)
        )
        for kind in ("empty", "holding")
    }
    bars(
        out / f"{NAME}.png",
        {
            f"{a}, {kind}": summary[a][kind]["request_to_ready_s"]["median"]
            for a in ARMS
            for kind in ("empty", "holding")
        },
        ylabel="request → ready, s (median)",
        title=f"Leaking worker restarted: spawn vs fork server ({held} results held or none)",
    )
    return {
        "rounds": rounds,
        "held": held,
        "load_1min": {"median": statistics.median(load), "min": min(load), "max": max(load)},
        "summary": summary,
        "before_over_after": ratios,
        "trials": trials,
    }
