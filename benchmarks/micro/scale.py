"""How the scheduler side's costs grow: fallback checks, hooks, bursts, trickling tasks.

All on an in-process scheduler (``LocalCluster(processes=False)``), so the plugin's own
methods can be timed directly:

- **check**: one fallback check (``PlacementPlugin.fallback.check``) with N GPU tasks
  unrunnable (no GPU worker), nothing due: with a timeout on every task, and with none.
  The check pops only what is due, so it should not grow with N.
- **hooks**: ``update_graph`` per task, and the ``transition`` hook per call, for plain
  tasks, GPU tasks, and GPU tasks with a timeout.
- **burst**: N timed GPU tasks falling back in one check: seconds per task, and how many
  ``fallback`` events it logged.
- **trickle**: N GPU tasks whose inputs finish one by one, each entering ``no-worker``
  alone (a timeout of an hour: they wait), against plain distributed: wall ratio of
  paired, alternating rounds.
- **workers**: workers with verified GPUs registering one by one (MIG devices), timed by
  :mod:`benchmarks.micro.registration`.

Run with ``python -m benchmarks scale`` (``--quick``: :data:`QUICK_SIZES`, small bursts
and trickles, 7 workers).
"""

from __future__ import annotations

import gc
import statistics
import time
from pathlib import Path
from typing import Any

import dask
from distributed import Client, LocalCluster

import accelsched
from accelsched.protocol import PLACEMENT_PLUGIN
from benchmarks.micro.registration import many_workers

NAME = "scale"
#: Unrunnable tasks the ``--quick`` check cost is timed with (a smoke run: two sizes, so
#: the figures still have the shape of the full run's).
QUICK_SIZES = (100, 300)


def inc(i: int) -> int:
    return i + 1


def gpu_step(i: int) -> int:
    return i


def _cluster(workers: int = 0) -> tuple[LocalCluster, Client]:
    cluster = LocalCluster(
        n_workers=workers, threads_per_worker=1, processes=False, dashboard_address=":0"
    )
    return cluster, Client(cluster)


def _wait_states(cluster: LocalCluster, keys: list, state: str, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    assert cluster.scheduler is not None
    tasks = cluster.scheduler.tasks
    while not all(k in tasks and tasks[k].state == state for k in keys):
        if time.monotonic() > deadline:
            raise TimeoutError(f"tasks did not reach {state}")
        time.sleep(0.05)


def _time_checks(repeat: int, dask_scheduler: Any = None) -> list[float]:
    """On the scheduler's event loop: seconds of ``repeat`` fallback checks."""
    fallback = dask_scheduler.plugins[PLACEMENT_PLUGIN].fallback
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fallback.check()
        times.append(time.perf_counter() - t0)
    return times


def _burst_check(dask_scheduler: Any = None) -> float:
    """On the scheduler's event loop: make every waiting task due, time one check."""
    plugin = dask_scheduler.plugins[PLACEMENT_PLUGIN]
    fallback = plugin.fallback
    now = time.monotonic()
    keys = [ts.key for ts in dask_scheduler.unrunnable]
    for key in keys:
        task = fallback.tasks[key]
        task.timeout, task.due = 0.0, now  # unrunnable before now: due
        fallback.deadlines.add(key, now)
    t0 = time.perf_counter()
    fallback.check()
    return time.perf_counter() - t0


def check_cost(sizes: list[int]) -> list[dict[str, Any]]:
    """One check's seconds with N unrunnable GPU tasks, nothing due."""
    rows = []
    for n in sizes:
        for timeout in ("1h", None):
            cluster, client = _cluster()
            with cluster, client:
                accelsched.register(client, fallback_timeout=timeout)
                futs = client.map(gpu_step, range(n), resources={"GPU": 1}, pure=False)
                _wait_states(cluster, [f.key for f in futs], "no-worker")
                times = client.run_on_scheduler(_time_checks, 50)
                rows.append(
                    {
                        "unrunnable": n,
                        "timeout": timeout,
                        "check_us_median": round(statistics.median(times) * 1e6, 1),
                        "check_us_max": round(max(times) * 1e6, 1),
                    }
                )
                del futs
    return rows


def hook_cost(n: int) -> list[dict[str, Any]]:
    """Per-task update_graph and per-call transition costs of the plugin's hooks."""
    rows = []
    cluster, client = _cluster()
    with cluster, client:
        accelsched.register(client)
        assert cluster.scheduler is not None
        plugin = cluster.scheduler.plugins[PLACEMENT_PLUGIN]
        spent = {"graph": 0.0, "tasks": 0, "transition": 0.0, "calls": 0}
        update_graph, transition = plugin.update_graph, plugin.transition

        def timed_graph(scheduler: Any, **kw: Any) -> None:
            t0 = time.perf_counter()
            update_graph(scheduler, **kw)
            spent["graph"] += time.perf_counter() - t0
            spent["tasks"] += len(kw.get("tasks") or ())

        def timed_transition(*args: Any, **kw: Any) -> None:
            t0 = time.perf_counter()
            transition(*args, **kw)
            spent["transition"] += time.perf_counter() - t0
            spent["calls"] += 1

        plugin.update_graph = timed_graph  # type: ignore[method-assign]
        plugin.transition = timed_transition  # type: ignore[method-assign]
        cases: tuple[tuple[str, dict[str, Any], dict[str, Any]], ...] = (
            ("plain", {}, {}),
            ("gpu", {"resources": {"GPU": 1}}, {}),
            ("gpu+timeout", {}, {"resources": {"GPU": 1}, "fallback_timeout": "1h"}),
        )
        for label, kw, annotations in cases:
            spent.update(graph=0.0, tasks=0, transition=0.0, calls=0)
            with dask.annotate(**annotations):
                futs = client.map(gpu_step, range(n), pure=False, **kw)
            _wait_states(
                cluster, [f.key for f in futs], "no-worker" if label != "plain" else "queued"
            )
            rows.append(
                {
                    "tasks": label,
                    "update_graph_us_per_task": round(spent["graph"] / spent["tasks"] * 1e6, 2),
                    "transition_us_per_call": round(
                        spent["transition"] / max(spent["calls"], 1) * 1e6, 2
                    ),
                }
            )
            del futs
            time.sleep(0.5)
    return rows


def burst(n: int) -> dict[str, Any]:
    """N GPU tasks with timeout 0 on a cluster with one GPU-less worker: one check."""
    cluster, client = _cluster(workers=1)
    with cluster, client:
        accelsched.register(client, fallback_timeout="1h")
        futs = client.map(gpu_step, range(n), resources={"GPU": 1}, pure=False)
        _wait_states(cluster, [f.key for f in futs], "no-worker")
        events_before = len(client.get_events("accelsched"))
        t0 = time.perf_counter()
        check = client.run_on_scheduler(_burst_check)
        _wait_states(cluster, [f.key for f in futs], "memory", timeout=600)
        seconds = time.perf_counter() - t0
        logged = [
            m
            for _, m in client.get_events("accelsched")[events_before:]
            if m.get("action") == "fallback"
        ]
        return {
            "tasks": n,
            "check_s": round(check, 4),
            "check_us_per_task": round(check / n * 1e6, 2),
            "seconds_to_all_results": round(seconds, 3),
            "fallback_events": len(logged),
            "counted": sum(m.get("count", 1) for m in logged),
        }


def trickle(n: int, rounds: int) -> dict[str, Any]:
    """N GPU tasks entering no-worker one at a time: accelsched / plain wall ratio."""
    walls: dict[str, list[float]] = {"plain": [], "accelsched": []}
    for r in range(rounds):
        order = ["plain", "accelsched"] if r % 2 == 0 else ["accelsched", "plain"]
        for name in order:
            cluster, client = _cluster(workers=1)
            with cluster, client:
                if name == "accelsched":
                    accelsched.register(client, fallback_timeout="1h")
                gc.collect()
                t0 = time.perf_counter()
                inputs = client.map(inc, range(n), pure=False)
                with dask.annotate(resources={"GPU": 1}):
                    gpu = client.map(gpu_step, inputs, pure=False)
                _wait_states(cluster, [f.key for f in gpu], "no-worker")
                walls[name].append(time.perf_counter() - t0)
                del inputs, gpu
    ratios = [a / p for p, a in zip(walls["plain"], walls["accelsched"], strict=True)]
    return {
        "tasks": n,
        "rounds": rounds,
        "ratio_median": round(statistics.median(ratios), 3),
        "ratio_min": round(min(ratios), 3),
        "ratio_max": round(max(ratios), 3),
        "plain_s_median": round(statistics.median(walls["plain"]), 3),
        "accelsched_s_median": round(statistics.median(walls["accelsched"]), 3),
    }


def plot(result: dict[str, Any], out: Path) -> list[Path]:
    from benchmarks.harness.plots import plt, save  # the Agg backend, as every benchmark draws

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for timeout in ("1h", None):
        rows = [r for r in result["check"] if r["timeout"] == timeout]
        ax.plot(
            [r["unrunnable"] for r in rows],
            [r["check_us_median"] for r in rows],
            marker="o",
            label=f"timeout {timeout or 'none'}",
        )
    ax.axhline(1000, color="red", ls="--", lw=0.8, label="target 1 ms")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("unrunnable GPU tasks")
    ax.set_ylabel("one fallback check, µs (median)")
    ax.legend(fontsize=8)
    return [save(fig, out / f"{NAME}.png", dpi=110)]


def run(quick: bool, out: Path) -> dict[str, Any]:
    """Every part in turn, each on clusters of its own."""
    out.mkdir(parents=True, exist_ok=True)
    sizes = list(QUICK_SIZES) if quick else [10_000, 100_000, 300_000]
    result: dict[str, Any] = {
        "check": check_cost(sizes),
        "hooks": hook_cost(100 if quick else 20_000),
        "burst": burst(50 if quick else 10_000),
        "trickle": trickle(30 if quick else 10_000, 2 if quick else 5),
        "workers": many_workers(7 if quick else 112),
    }
    result["plots"] = [p.name for p in plot(result, out)]
    return result
