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

Usage::

    python -m benchmarks scale [--quick]
    python -m benchmarks.bench_scale [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import time
from pathlib import Path
from typing import Any

import dask
from distributed import Client, LocalCluster

import accelsched
from accelsched.protocol import PLACEMENT_PLUGIN

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
        n_workers=workers, threads_per_worker=1, processes=False, dashboard_address=None
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
        fallback.timeouts[key] = 0.0
        fallback.deadlines.discard(key)
        fallback.deadlines.add(key, now, now)
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


async def _register_workers(n: int, uuids: list[str]) -> dict[str, Any]:
    """Start ``n`` in-process workers one by one, each owning one (MIG) device; time
    each from start to its GPU verified, and the scheduler's accelsched handlers."""
    import os

    from distributed import Client as AsyncClient
    from distributed import Scheduler, Worker

    from accelsched.protocol import INVENTORY_HANDLER, OFFER_HANDLER

    spent: dict[str, list[float]] = {INVENTORY_HANDLER: [], OFFER_HANDLER: []}
    verify: list[float] = []
    workers: list[Worker] = []
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    async with (
        Scheduler(port=0, dashboard_address=":0") as s,
        AsyncClient(s.address, asynchronous=True) as c,
    ):
        await accelsched.register(c, check_interval="1h")  # type: ignore[misc]
        for name in spent:  # time the handlers the guards call
            handler = s.handlers[name]

            def timing(handler: Any, name: str) -> Any:
                async def timed(comm: Any = None, **kw: Any) -> Any:
                    t0 = time.perf_counter()
                    out = await handler(comm, **kw)
                    spent[name].append(time.perf_counter() - t0)
                    return out

                return timed

            s.handlers[name] = timing(handler, name)
        # accelsched's own work on the event loop (the handlers above also wait for the
        # worker's confirmation, a round trip that here shares one loop with every worker)
        plugin = s.plugins[PLACEMENT_PLUGIN]
        own: list[float] = []

        def sync_timing(obj: Any, attr: str) -> None:
            original = getattr(obj, attr)

            def timed_sync(*a: Any, **kw: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return original(*a, **kw)
                finally:
                    own.append(time.perf_counter() - t0)

            setattr(obj, attr, timed_sync)

        for obj, attr in (
            (plugin.grants, "claim"),
            (plugin.counts, "place"),
            (plugin.reports, "_emit"),
            (plugin.counts, "add_worker"),
            (plugin.observer, "add_worker"),
        ):
            if hasattr(obj, attr):
                sync_timing(obj, attr)
        own_per_worker: list[float] = []
        try:
            for i in range(n):
                os.environ["CUDA_VISIBLE_DEVICES"] = uuids[i]  # read by the guard's probe
                t0 = time.perf_counter()
                w = await Worker(s.address, nthreads=1, resources={"GPU": 1}, name=f"w{i}")
                workers.append(w)
                while s.workers[w.address].resources.get("GPU", 0) < 1:
                    await asyncio.sleep(0.001)
                verify.append(time.perf_counter() - t0)
                own_per_worker.append(sum(own))
                own.clear()
            verified = sum(1 for ws in s.workers.values() if ws.resources.get("GPU", 0) >= 1)
        finally:
            if saved is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = saved
            await asyncio.gather(*(w.close() for w in workers))
    tenth = max(1, n // 10)

    def ms(values: list[float]) -> float:
        return round(statistics.median(values) * 1e3, 2)

    calls = sorted(spent[INVENTORY_HANDLER] + spent[OFFER_HANDLER])
    return {
        "workers": n,
        "verified": verified,
        "start_to_verified_ms": {
            "first_tenth": ms(verify[:tenth]),
            "last_tenth": ms(verify[-tenth:]),
        },
        "inventory_handler_ms": {
            "first_tenth": ms(spent[INVENTORY_HANDLER][:tenth]),
            "last_tenth": ms(spent[INVENTORY_HANDLER][-tenth:]),
        },
        "handler_calls": len(calls),
        "own_work_us_per_worker": {
            "first_tenth": round(statistics.median(own_per_worker[:tenth]) * 1e6, 1),
            "last_tenth": round(statistics.median(own_per_worker[-tenth:]) * 1e6, 1),
        },
        "per_worker_ms": [round(v * 1e3, 2) for v in verify],
    }


def many_workers(n: int) -> dict[str, Any]:
    """``n`` workers with verified GPUs: 16 simulated GPUs split into 7 MIG devices each
    give up to 112 devices, one owner each."""
    from accelsched.testing import fake_gpus

    gpus = -(-n // 7)
    with fake_gpus(count=gpus, memory="80GiB", mig=["1g.10gb"] * 7) as fake:
        uuids = [u for d in range(gpus) for u in fake.mig_uuids(d)]
        return asyncio.run(_register_workers(n, uuids))


def plot(result: dict[str, Any], out: Path) -> list[Path]:
    from benchmarks.plots import plt, save  # the Agg backend, as every benchmark draws

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
    """The entry point's hook."""
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    result = run(args.quick, args.out)
    print(json.dumps(result, indent=1, default=str))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
