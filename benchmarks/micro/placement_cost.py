"""What a GPU task costs the scheduler as the cluster grows: count, requirement, plain.

A scheduler process (``dask scheduler``) and host processes holding the workers
in-process (each owning one simulated MIG device, as :mod:`benchmarks.micro.registration`
does), so the scheduler's CPU time (``time.process_time`` in its own process) is its
alone. One host holds up to
:data:`~benchmarks.micro.worker_hosts.PER_HOST` workers; a larger cluster is split evenly
over as few hosts as hold it, each with its own simulated devices. Per
cluster size, in paired rounds of alternating order on one accelsched cluster:

- **count**: ``resources={"GPU": 1}`` tasks;
- **requirement**: tasks of a step marked ``gpu(model="*")``: one eligible class
  (:class:`accelsched.scheduler.fallback.Eligible`), met by every worker;

and on a second cluster without accelsched (the workers declare ``GPU=1``), **plain**
distributed's ``resources={"GPU": 1}`` tasks. Each round submits N trivial tasks and
times the scheduler's CPU until they are all done: CPU µs per task, and per round the
requirement/count ratio (the median of those ratios is the figure). Memory per waiting
task: N tasks of each kind held ``waiting`` behind one unfinished input, the scheduler's
RSS before and after, over N.

Per cluster also the time from the hosts' start to every GPU placed (accelsched: verified),
and the scheduler's CPU in it (``ready``).

``--quick``: 4 workers, 300 tasks, 2 rounds. ``--workers N``: that size only; the
plot also draws the sizes of the results file it replaces (``OUT/placement_cost.json``),
which the figures carry as ``earlier`` with that run's provenance.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from distributed import Client, Event

import accelsched
from benchmarks.micro.worker_hosts import HOST, split

NAME = "placement_cost"
SIZES = (8, 32, 48, 64, 256)
QUICK_SIZES = (4,)


def inc(i: int) -> int:
    return i + 1


@accelsched.gpu(model="*")
def met_by_all(i: int) -> int:
    return i + 1


def held(i: int, gate: int) -> int:
    return i


@accelsched.gpu(model="*")
def held_met_by_all(i: int, gate: int) -> int:
    return i


def _gate(name: str) -> int:
    Event(name).wait()
    return 0


def _scheduler_cpu(dask_scheduler: Any = None) -> float:
    return time.process_time()


def _scheduler_rss(dask_scheduler: Any = None) -> int:
    import psutil

    gc.collect()
    return int(psutil.Process().memory_info().rss)


def _task_count(dask_scheduler: Any = None) -> int:
    return len(dask_scheduler.tasks)


def _gpu_counts(dask_scheduler: Any = None) -> list[float]:
    return [ws.resources.get("GPU", 0) for ws in dask_scheduler.workers.values()]


@contextmanager
def _cluster(n: int, plain: bool, tmp: Path) -> Iterator[tuple[Client, dict[str, float]]]:
    """A scheduler and hosts of ``n`` workers in all, stopped however the block ends; a
    client with accelsched registered (unless ``plain``) and every worker's GPU placed,
    and what getting there took: seconds from the hosts' start, the scheduler's CPU."""
    file = tmp / f"scheduler-{n}-{plain}.json"
    root = str(Path(__file__).resolve().parents[2])  # both unpickle this module's functions
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    quiet: dict[str, Any] = {
        "stdout": subprocess.DEVNULL,
        "stderr": subprocess.DEVNULL,
        # distributed's own GPU diagnostics off in this benchmark's processes: the fake
        # library finds a MIG device by UUID for the first 16 GPUs only (here up to 19)
        "env": {**os.environ, "PYTHONPATH": path, "DASK_DISTRIBUTED__DIAGNOSTICS__NVML": "False"},
    }
    dask = str(Path(sys.executable).with_name("dask"))
    started: list[subprocess.Popen] = []
    client: Client | None = None
    try:
        started.append(
            subprocess.Popen(
                [dask, "scheduler", "--port", "0", "--no-dashboard", "--scheduler-file", str(file)],
                **quiet,
            )
        )
        deadline = time.monotonic() + 60
        while not file.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        client = Client(scheduler_file=str(file))
        if not plain:
            accelsched.register(client, check_interval="1h", fast_restart=False)
        address = str(client.scheduler_info()["address"])
        cpu, start, first = client.run_on_scheduler(_scheduler_cpu), time.monotonic(), 0
        for size in split(n):
            args = [address, str(first), str(size), "0" if plain else "1"]
            started.append(subprocess.Popen([sys.executable, "-c", HOST, *args], **quiet))
            first += size
        deadline = time.monotonic() + 60 + 2 * n
        while True:
            counts = client.run_on_scheduler(_gpu_counts)
            if len(counts) == n and all(c == 1 for c in counts):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"{n} workers with a verified GPU: {counts}")
            time.sleep(0.2)
        ready = {
            "seconds": round(time.monotonic() - start, 1),
            "scheduler_cpu_s": round(client.run_on_scheduler(_scheduler_cpu) - cpu, 2),
        }
        yield client, ready
    finally:
        if client is not None:
            try:
                client.shutdown()
            finally:
                client.close()
        for process in reversed(started):
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()


# --- the measurements --------------------------------------------------------------------


def _cpu_per_task(client: Client, kind: str, n: int) -> float:
    """Scheduler CPU µs per task for ``n`` trivial tasks of ``kind``, submit to done."""
    before = client.run_on_scheduler(_scheduler_cpu)
    if kind == "requirement":
        futures = client.map(met_by_all, range(n), pure=False)
    else:
        futures = client.map(inc, range(n), resources={"GPU": 1}, pure=False)
    client.gather(futures)
    del futures
    return (client.run_on_scheduler(_scheduler_cpu) - before) / n * 1e6


def _bytes_per_waiting_task(client: Client, kind: str, n: int) -> float:
    """Scheduler RSS growth per task held ``waiting`` behind an unfinished input."""
    name = f"gate-{kind}-{time.monotonic()}"
    gate = client.submit(_gate, name, pure=False)
    before = client.run_on_scheduler(_scheduler_rss)
    if kind == "requirement":
        futures = client.map(held_met_by_all, range(n), [gate] * n, pure=False)
    else:
        futures = client.map(held, range(n), [gate] * n, resources={"GPU": 1}, pure=False)
    while client.run_on_scheduler(_task_count) <= n:  # until the graph has arrived
        time.sleep(0.05)
    after = client.run_on_scheduler(_scheduler_rss)
    Event(name, client=client).set()
    client.gather(futures)
    del futures, gate
    return (after - before) / n


def _cluster_rounds(n: int, plain: bool, tasks: int, rounds: int, tmp: Path) -> dict[str, Any]:
    """Paired rounds on one cluster: accelsched's or ``plain`` distributed's."""
    kinds = ["plain"] if plain else ["count", "requirement"]
    with _cluster(n, plain, tmp) as (client, ready):
        _cpu_per_task(client, kinds[0], min(tasks, 200))  # warm up
        cpu: dict[str, list[float]] = {k: [] for k in kinds}
        for r in range(rounds):
            for kind in kinds if r % 2 == 0 else kinds[::-1]:
                cpu[kind].append(_cpu_per_task(client, kind, tasks))
        memory = {k: _bytes_per_waiting_task(client, k, tasks) for k in kinds}
    return {"cpu_us": cpu, "bytes_per_waiting_task": memory, "ready": ready}


def _spread(values: list[float]) -> dict[str, float]:
    return {
        "median": round(statistics.median(values), 2),
        "min": round(min(values), 2),
        "max": round(max(values), 2),
    }


def measure(n: int, tasks: int, rounds: int, tmp: Path) -> dict[str, Any]:
    started = time.monotonic()
    ours = _cluster_rounds(n, False, tasks, rounds, tmp)
    plain = _cluster_rounds(n, True, tasks, rounds, tmp)
    cpu = {**ours["cpu_us"], **plain["cpu_us"]}
    ratios = [r / c for r, c in zip(cpu["requirement"], cpu["count"], strict=True)]
    return {
        "workers": n,
        "hosts": len(split(n)),
        "tasks": tasks,
        "rounds": rounds,
        "seconds": round(time.monotonic() - started, 1),
        "scheduler_cpu_us_per_task": {k: _spread(v) for k, v in cpu.items()},
        "requirement_over_count": _spread(ratios),
        "count_over_plain": round(
            statistics.median(cpu["count"]) / statistics.median(cpu["plain"]), 3
        ),
        "bytes_per_waiting_task": {
            k: round(v) for part in (ours, plain) for k, v in part["bytes_per_waiting_task"].items()
        },
        # hosts started -> every worker's GPU placed (accelsched: verified)
        "ready": {"accelsched": ours["ready"], "plain": plain["ready"]},
    }


def plot(rows: list[dict[str, Any]], out: Path) -> list[Path]:
    from benchmarks.harness.plots import plt, save

    fig, (cpu, mem) = plt.subplots(1, 2, figsize=(10, 3.8))
    workers = [r["workers"] for r in rows]
    for kind in ("plain", "count", "requirement"):
        cpu.plot(
            workers,
            [r["scheduler_cpu_us_per_task"][kind]["median"] for r in rows],
            marker="o",
            label=kind,
        )
        mem.plot(workers, [r["bytes_per_waiting_task"][kind] for r in rows], marker="o", label=kind)
    cpu.set_xscale("log", base=2)
    mem.set_xscale("log", base=2)
    cpu.set_xlabel("workers")
    mem.set_xlabel("workers")
    cpu.set_ylabel("scheduler CPU per task, µs (median of rounds)")
    mem.set_ylabel("scheduler RSS per waiting task, bytes")
    cpu.legend(fontsize=8)
    mem.legend(fontsize=8)
    return [save(fig, out / f"{NAME}.png", dpi=110)]


def _earlier(out: Path, measured: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The sizes of the results file this run replaces that it did not measure, each with
    the run it came from (``from``: that run's commit, command, start and load): what
    ``--workers`` draws beside its one size. Nothing from a quick run."""
    try:
        previous = json.loads((out / f"{NAME}.json").read_text())
    except (OSError, ValueError):
        return []
    if previous.get("quick"):
        return []
    prov = previous.get("provenance", {})
    source = {
        "commit": prov.get("git", {}).get("commit"),
        "command": prov.get("command"),
        "started": prov.get("started"),
        "load_average": prov.get("machine", {}).get("load_average"),
    }
    rows = {r["workers"]: r for r in previous.get("earlier", [])}  # older first
    rows.update({r["workers"]: {**r, "from": source} for r in previous.get("sizes", [])})
    done = {r["workers"] for r in measured}
    return [rows[n] for n in sorted(rows) if n not in done]


def run(
    quick: bool, out: Path, rounds: int | None = None, workers: int | None = None
) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    sizes = (workers,) if workers else QUICK_SIZES if quick else SIZES
    tasks = 300 if quick else 3_000
    rounds = rounds or (2 if quick else 5)
    rows, errors = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for n in sizes:
            try:
                rows.append(measure(n, tasks, rounds, Path(tmp)))
            except Exception as exc:  # the sizes measured are kept
                errors.append(f"{n} workers: {exc!r}")
    earlier = _earlier(out, rows) if workers else []
    drawn = sorted(rows + earlier, key=lambda r: r["workers"])
    plots = [p.name for p in plot(drawn, out)] if drawn else []
    return {
        "sizes": rows,
        "plots": plots,
        **({"earlier": earlier} if earlier else {}),
        **({"errors": errors} if errors else {}),
    }
