"""What accelsched costs per task: paired rounds against plain distributed.

Two configurations, each with two clusters identical but for accelsched (one gets
``accelsched.register``, the other is plain distributed), whose two single-thread
workers see two simulated GPUs (``accelsched.testing.fake_gpus``) and own one each
(``resources={"GPU": 1}``):

- ``cli``: the clusters side by side for the whole run, each a ``dask scheduler``
  process and two ``dask worker`` processes with their nannies, as the command line
  starts them (:mod:`benchmarks.micro.cli_cluster`);
- ``in_process``: a fresh cluster per round and side, its scheduler in this process
  (``SpecCluster``) and two ``Nanny`` workers, as a script or notebook starts one
  (:mod:`benchmarks.micro.in_process_cluster`).

Every round runs the same workload on both sides, in alternating order:

- ``gpu``: tiny tasks asking for ``resources={"GPU": 1}`` (placed, bound, measured by
  accelsched; merely counted by plain distributed);
- ``cpu``: tiny tasks asking for nothing, on the same GPU-seeing workers (watched for
  unrequested GPU use by accelsched).
- ``gpu_context`` (command line only, last): the ``gpu`` tasks again after one task on
  each worker of both clusters made a (simulated) CUDA context, as real GPU work makes
  one; accelsched's guard then measures GPU tasks (NVML process-list reads on a sample
  of a quiet prefix's runs, :mod:`accelsched.policy.leak`), plain distributed does
  nothing more. Its worker CPU ratio per task is the context hot path's end-to-end cost.

Per round and cluster: wall time from submit to the last result, and CPU seconds spent
by the scheduler and by the worker processes, divided by the task count (in process,
the scheduler's figure is this whole process: the scheduler and the client); the
workers' also by thread role (:mod:`benchmarks.micro.worker_threads`). The
figures are the medians over rounds of the paired ratio (accelsched / plain) and of the
paired CPU differences, with their spread (min, max).

Run with ``python -m benchmarks overhead [--rounds 7]`` (``--quick``: 30 tasks, 5
rounds, 1 with a context, command-line workers without nannies: a smoke run whose ratios
are noise).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
from distributed import Client

import accelsched
from accelsched import internals
from accelsched.testing import fake_gpus
from benchmarks.micro.cli_cluster import cli_cluster, cpu_seconds, worker_processes
from benchmarks.micro.in_process_cluster import in_process_cluster
from benchmarks.micro.overhead_report import plot
from benchmarks.micro.worker_threads import ROLES, Roles, counted, thread_cpu, thread_roles

NAME = "overhead"


def tiny(i: int) -> int:
    return i + 1


def _round(
    client: Client, sched: psutil.Process, workers: list, n: int, gpu: bool, roles: Roles
) -> dict:
    """One round of ``n`` tasks: its wall time and CPU per task, the scheduler's, the
    workers' and their threads' by ``roles`` (:func:`thread_roles`; none named: other)."""
    kw: dict[str, Any] = {"resources": {"GPU": 1}} if gpu else {}
    s0, w0 = cpu_seconds(sched), sum(cpu_seconds(w) for w in workers)
    r0 = thread_cpu(workers, roles)
    t0 = time.perf_counter()
    futures = client.map(tiny, range(n), pure=False, **kw)
    client.gather(futures)
    wall = time.perf_counter() - t0
    s1, w1 = cpu_seconds(sched), sum(cpu_seconds(w) for w in workers)
    r1 = thread_cpu(workers, roles)
    del futures
    return {
        "wall": wall,
        "sched_us": (s1 - s0) / n * 1e6,
        "worker_us": (w1 - w0) / n * 1e6,
        "threads_us": {role: (r1[role] - r0[role]) / n * 1e6 for role in ROLES},
    }


def _time_nvml_reads() -> None:
    """In a worker: time every NVML process-memory read from now on (CPU of the calling
    thread and wall), the read the guard makes per GPU task (run with ``client.run``)."""
    from accelsched import devices

    monitor = devices.NVMLMonitor
    if hasattr(monitor, "_bench_timed"):
        return
    original = monitor.process_memory
    times: list[tuple[float, float]] = []

    def timed(self: Any, index: int) -> Any:
        cpu, wall = time.thread_time(), time.perf_counter()
        try:
            return original(self, index)
        finally:
            times.append((time.thread_time() - cpu, time.perf_counter() - wall))

    monitor.process_memory = timed  # type: ignore[method-assign]
    monitor._bench_timed = (original, times)  # type: ignore[attr-defined]


def _nvml_reads_timed() -> list[tuple[float, float]]:
    """In a worker: stop timing; the (CPU, wall) seconds of each read since."""
    from accelsched import devices

    original, times = devices.NVMLMonitor._bench_timed  # type: ignore[attr-defined]
    devices.NVMLMonitor.process_memory = original  # type: ignore[method-assign]
    del devices.NVMLMonitor._bench_timed  # type: ignore[attr-defined]
    return list(times)


def _make_context() -> int:
    """In a GPU task: a CUDA context on its device, as the first real GPU work makes (on
    plain distributed, which binds no device, the worker's first visible one)."""
    from accelsched.testing import create_context

    create_context(accelsched.current_device() or 0)
    return 0


def _make_contexts(client: Client) -> None:
    """One task on each worker makes a context there (it stays for the process's life)."""
    for addr in internals.workers_listed(client):
        client.submit(_make_context, resources={"GPU": 1}, workers=[addr], pure=False).result()


def _nvml_read_cost(
    client: Client, sched: psutil.Process, workers: list, n: int, context: bool = False
) -> dict:
    """One more round of GPU tasks with each NVML read timed inside the workers: how
    many the guard makes and what each costs where it runs, beside the event loop.

    Without a context (the tiny tasks of the rounds above make none) no reading can be a
    base: the guard reads only now and then. With ``context``, made first on each worker,
    GPU tasks are measured (one closing reading, the next task's base): every run of a
    new prefix, then a sample of a quiet prefix's runs (:mod:`accelsched.policy.leak`)."""
    if context:
        _make_contexts(client)
    client.run(_time_nvml_reads)
    _round(client, sched, workers, n, True, {})  # (reads counted, not threads)
    reads = [t for ts in client.run(_nvml_reads_timed).values() for t in ts]
    return {
        "reads": len(reads),
        "reads_per_task": round(len(reads) / n, 3),
        "cpu_us": _spread([c * 1e6 for c, _ in reads] or [0.0]),
        "wall_us": _spread([w * 1e6 for _, w in reads] or [0.0]),
    }


def _spread(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {
        "median": round(statistics.median(values), 4),
        "min": round(min(values), 4),
        "max": round(max(values), 4),
    }


def _sides(pairs: list[tuple[dict, dict]], figure: Callable[[dict], float]) -> dict[str, Any]:
    """A per-task figure on both sides, and its paired difference."""
    plain, acc = [figure(p) for p, _ in pairs], [figure(a) for _, a in pairs]
    delta = [a - p for p, a in zip(plain, acc, strict=True)]
    return {"plain": _spread(plain), "accelsched": _spread(acc), "delta": _spread(delta)}


def _summary(rows: dict[str, list[dict]]) -> dict[str, Any]:
    """Paired figures of one kind of task: ratios and differences, round by round."""
    pairs = list(zip(rows["plain"], rows["accelsched"], strict=True))
    return {
        "wall_ratio": _spread([a["wall"] / p["wall"] for p, a in pairs]),
        "plain_wall_s": _spread([p["wall"] for p, _ in pairs]),
        "accelsched_wall_s": _spread([a["wall"] for _, a in pairs]),
        "scheduler_cpu_us_per_task": _sides(pairs, lambda r: r["sched_us"]),
        "worker_cpu_us_per_task": _sides(pairs, lambda r: r["worker_us"]),
        # a round too short for the CPU clock's ticks reads 0 on plain: no ratio from it
        "worker_cpu_ratio": _spread(
            [a["worker_us"] / p["worker_us"] for p, a in pairs if p["worker_us"] > 0]
        ),
        # the same by thread (benchmarks.micro.worker_threads): where a difference lies
        "worker_thread_cpu_us_per_task": {
            role: _sides(pairs, lambda r, role=role: r["threads_us"][role])  # type: ignore[misc]
            for role in ROLES
        },
        "rounds": rows,
    }


def _ready(client: Client, label: str) -> None:
    """Both GPUs verified before measuring."""
    deadline = time.monotonic() + 60
    while _verified(client) < 2:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{label} cluster: GPUs not verified")
        time.sleep(0.05)


def _paired(clusters: dict[str, tuple], tasks: int, rounds: int, gpu: bool) -> dict[str, Any]:
    """A warm-up round on each side, then ``rounds`` paired rounds in alternating order."""
    roles = {}
    for name, (client, sched, workers) in clusters.items():  # warm up: contexts, imports
        _round(client, sched, workers, min(200, tasks), gpu, {})
        roles[name] = thread_roles(client)
    rows: dict[str, list[dict]] = {"plain": [], "accelsched": []}
    for r in range(rounds):
        for name in ["plain", "accelsched"] if r % 2 == 0 else ["accelsched", "plain"]:
            client, sched, workers = clusters[name]
            rows[name].append(_round(client, sched, workers, tasks, gpu, roles[name]))
    # the threads each side's workers' roles were read from
    return {**_summary(rows), "threads_named": {k: counted(v) for k, v in roles.items()}}


def measure_cli(
    tasks: int, rounds: int, tmp: Path, nanny: bool = True, context_rounds: int = 5
) -> dict[str, Any]:
    """The command-line configuration: both clusters up for the whole run. Last, as a
    context stays for a process's life: ``context_rounds`` paired rounds of GPU tasks on
    workers of both clusters that each made a CUDA context first."""
    with (
        cli_cluster(tmp, "plain", nanny) as (plain, ps),
        cli_cluster(tmp, "accelsched", nanny) as (acc, accs),
    ):
        accelsched.register(acc)
        acc.wait_for_workers(2)
        _ready(acc, "accelsched")
        clusters = {
            "plain": (plain, ps, worker_processes(plain)),
            "accelsched": (acc, accs, worker_processes(acc)),
        }
        result: dict[str, Any] = {}
        for kind in ("gpu", "cpu"):
            result[kind] = _paired(clusters, tasks, rounds, kind == "gpu")
            if kind == "gpu":
                result[kind]["nvml_read_no_context"] = _nvml_read_cost(
                    *clusters["accelsched"], tasks
                )
        # it leaves a context on each accelsched worker: reads right after (a new
        # prefix's first runs, each measured), timed, so apart from the paired rounds
        result["gpu"]["nvml_read"] = _nvml_read_cost(*clusters["accelsched"], tasks, True)
        _make_contexts(plain)  # both sides alike: plain distributed's workers too
        context = result["gpu_context"] = _paired(clusters, tasks, context_rounds, True)
        # the reads the guard makes once its sampling settled, as in the rounds above
        context["nvml_read"] = _nvml_read_cost(*clusters["accelsched"], tasks)
        return result


def measure_in_process(tasks: int, rounds: int) -> dict[str, Any]:
    """The in-process configuration: a fresh pair of clusters every round, started in
    alternating order; each runs a warm-up, the GPU tasks, then the CPU tasks."""
    here = psutil.Process()
    rows: dict[str, dict[str, list[dict]]] = {
        kind: {"plain": [], "accelsched": []} for kind in ("gpu", "cpu")
    }
    for r in range(rounds):
        for name in ["plain", "accelsched"] if r % 2 == 0 else ["accelsched", "plain"]:
            with in_process_cluster(name) as client:
                if name == "accelsched":
                    accelsched.register(client)
                    _ready(client, name)
                workers = worker_processes(client)
                _round(client, here, workers, min(200, tasks), True, {})  # warm up
                roles = thread_roles(client)
                for kind in ("gpu", "cpu"):
                    rows[kind][name].append(
                        _round(client, here, workers, tasks, kind == "gpu", roles)
                    )
    return {kind: _summary(kind_rows) for kind, kind_rows in rows.items()}


def measure(
    tasks: int, rounds: int, tmp: Path, nanny: bool = True, context_rounds: int = 5
) -> dict[str, Any]:
    with fake_gpus(count=2):
        return {
            "tasks": tasks,
            "rounds": rounds,
            "context_rounds": context_rounds,
            "cli": measure_cli(tasks, rounds, tmp, nanny, context_rounds),
            "in_process": measure_in_process(tasks, rounds),
        }


def _verified(client: Client) -> int:
    """Workers whose GPU the scheduler places against (the scheduler process cannot
    import this module: ask through ``scheduler_info``)."""
    workers = internals.workers_listed(client).values()
    return sum(1 for w in workers if w.get("resources", {}).get("GPU", 0) >= 1)


def run(quick: bool, out: Path, rounds: int | None = None) -> dict[str, Any]:
    """``rounds`` paired rounds (``--rounds``; default 7, 5 with ``--quick``) of 2000
    tasks (30 with ``--quick``, on workers without nannies: a smoke run of seconds); as
    many with a CUDA context, at least 5 (1 with ``--quick``)."""
    out.mkdir(parents=True, exist_ok=True)
    tasks, default_rounds = (30, 5) if quick else (2000, 7)
    rounds = rounds or default_rounds
    context_rounds = 1 if quick else max(5, rounds)
    with tempfile.TemporaryDirectory() as tmp:  # scheduler files: not results
        result = measure(tasks, rounds, Path(tmp), not quick, context_rounds)
    result["plots"] = [p.name for p in plot(result, out)]
    return result
