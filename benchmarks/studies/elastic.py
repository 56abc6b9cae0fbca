"""Elastic pools on bursty mixed work, against a fixed cluster and distributed's Adaptive.

The workload, the same for every setup and driven by the clock (its arrivals do not wait
for the cluster): ``bursts`` bursts of GPU tasks, one every ``period`` seconds, each task
sleeping ``gpu_seconds`` on its simulated device (``resources={"GPU": 1}``, a 60 s
fallback timeout), and a steady CPU stream beside them, one plain task of ``cpu_seconds``
every ``cpu_every`` seconds from the first burst to the last. Three setups, each a fresh
process cluster with accelsched registered, on simulated GPUs through the real pynvml:

- ``elastic``: an empty ``LocalCluster`` under ``accelsched.adapt``, a ``gpu`` pool and a
  ``cpu`` pool of at most 2 workers each, idle workers retired after ``idle_after``.
- ``fixed``: the pools' maxima always on: 2 GPU and 2 CPU workers, started (and their
  GPUs verified) before the workload starts.
- ``adaptive``: distributed's own ``cluster.adapt(minimum=0, maximum=4)`` on one pool of
  GPU workers, which also run the CPU stream: what users do today.

Both adaptive setups look every 0.5 s, retire after 3 looks in a row (``target_duration``
5 s). Per run, from a scheduler plugin noting when each worker registers and leaves, and
accelsched's events: time to finish, GPU and CPU worker-seconds (workers registered x
time, from the first submission until the work is done and the cluster has given back
what it would, at most ``tail`` s later), worker starts, fallbacks, GPU tasks on a GPU,
CPU tasks on GPU workers, each burst's submission to its last task's end. Paired rounds.
``--quick``: 2 bursts of 4 tasks of 0.3 s, 5 s apart, a CPU task a second, idle_after 1 s, 1 round.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any, cast

import dask
import distributed
from distributed import Client, LocalCluster, Nanny, Scheduler, SchedulerPlugin, SpecCluster

import accelsched
from accelsched.testing import fake_gpus
from benchmarks.harness.clusters import events, until_empty, wait
from benchmarks.harness.plots import COLORS, plt, save
from benchmarks.harness.results import spread

NAME = "elastic"
SETUPS = ("elastic", "fixed", "adaptive")
POOLS = ("gpu", "cpu")
MAXIMUM = {"gpu": 2, "cpu": 2}
ADAPTIVE_MAXIMUM = 4
LOOK: dict[str, Any] = {"interval": "500ms", "wait_count": 3, "target_duration": "5s"}
FALLBACK_TIMEOUT = "60s"
QUIET = logging.CRITICAL


class DeviceNanny(Nanny):
    """A nanny for worker ``gpu-<n>`` that sees simulated GPU ``n`` only, as each host of a
    GPU pool sees its own device; a ``cpu-<n>`` worker sees none."""

    def __init__(self, *args: Any, name: str, **kwargs: Any) -> None:
        pool, _, n = str(name).rpartition("-")
        device = n if pool == "gpu" else ""
        kwargs["env"] = {**kwargs.get("env", {}), "CUDA_VISIBLE_DEVICES": device}
        super().__init__(*args, **{**kwargs, "name": name})


QUIET_OPTIONS = {"nthreads": 2, "silence_logs": QUIET}
GPU_SPEC = {"cls": DeviceNanny, "options": {**QUIET_OPTIONS, "resources": {"GPU": 1}}}
CPU_SPEC = {"cls": DeviceNanny, "options": QUIET_OPTIONS}


class GpuWorkers(SpecCluster):
    """distributed's ``SpecCluster`` growing GPU workers only, named ``gpu-<n>`` with the
    lowest free ``n`` (its own names count up for ever; each needs a device of its own)."""

    def _new_worker_name(self, worker_number: int) -> str:
        n = 0
        while f"gpu-{n}" in self.worker_spec:
            n += 1
        return f"gpu-{n}"


class Lifetimes(SchedulerPlugin):
    """Notes ``(seconds since the epoch, worker name, +1 joined / -1 left)`` on the
    scheduler: the worker-seconds come from these, not from sampling."""

    name = "benchmark-lifetimes"

    def __init__(self) -> None:
        self.records: list[tuple[float, str, int]] = []
        self.names: dict[str, str] = {}

    async def start(self, scheduler: Scheduler) -> None:  # those there before it
        for worker in scheduler.workers:
            self.add_worker(scheduler, worker)

    def add_worker(self, scheduler: Scheduler, worker: str) -> None:
        self.names[worker] = str(scheduler.workers[worker].name)
        self.records.append((time.time(), self.names[worker], 1))

    def remove_worker(self, scheduler: Scheduler, worker: str, **kwargs: Any) -> None:
        if worker in self.names:
            self.records.append((time.time(), self.names.pop(worker), -1))


def _records(dask_scheduler: Scheduler) -> list[tuple[float, str, int]]:
    return list(cast(Lifetimes, dask_scheduler.plugins[Lifetimes.name]).records)


def gpu_task(i: int, seconds: float) -> tuple[int | None, float]:
    """A GPU step: (the device it ran on, None on a CPU; when it ended)."""
    time.sleep(seconds)
    return accelsched.current_device(), time.time()


def cpu_task(i: int, seconds: float) -> str:
    """A plain step: the name of the worker it ran on."""
    time.sleep(seconds)
    return str(distributed.get_worker().name)


def _gpus(dask_scheduler: Scheduler) -> float:
    return sum(w.resources.get("GPU", 0) for w in dask_scheduler.running)


def _cluster(setup: str) -> SpecCluster:
    scheduler = {"cls": Scheduler, "options": {"dashboard_address": ":0"}}
    if setup == "elastic":
        return LocalCluster(n_workers=0, processes=True, dashboard_address=":0", silence_logs=QUIET)
    if setup == "fixed":
        specs = {f"{p}-{n}": GPU_SPEC if p == "gpu" else CPU_SPEC for p in POOLS for n in range(2)}
        return SpecCluster(workers=specs, scheduler=scheduler, silence_logs=QUIET)
    return GpuWorkers(workers={}, worker=GPU_SPEC, scheduler=scheduler, silence_logs=QUIET)


def _start(setup: str, cluster: SpecCluster, client: Client, w: dict[str, Any]) -> Any:
    """Register accelsched and the lifetimes plugin; start the setup's scaling (the fixed
    cluster: wait until its workers run and its GPUs are verified)."""
    client.register_plugin(Lifetimes())
    accelsched.register(client)
    if setup == "elastic":
        pools = {"gpu": {"spec": GPU_SPEC, "maximum": 2}, "cpu": {"spec": CPU_SPEC, "maximum": 2}}
        return accelsched.adapt(cluster, pools=pools, idle_after=w["idle_after"], **LOOK)
    if setup == "fixed":
        client.wait_for_workers(4, timeout=120)
        wait(lambda: client.run_on_scheduler(_gpus) == 2, 120, "two verified GPUs")
        return None
    return cluster.adapt(minimum=0, maximum=ADAPTIVE_MAXIMUM, **LOOK)


def _drive(client: Client, w: dict[str, Any]) -> dict[str, Any]:
    """Submit the workload on its clock; wait for all of it."""
    plan = [(b * w["period"], "gpu", b) for b in range(w["bursts"])]
    span = (w["bursts"] - 1) * w["period"]
    plan += [(k * w["cpu_every"], "cpu", k) for k in range(int(span / w["cpu_every"]) + 1)]
    plan.sort(key=lambda p: (p[0], p[1] != "gpu"))
    t0 = time.time()
    bursts: list[tuple[float, list[Any]]] = []
    cpu: list[Any] = []
    for at, kind, k in plan:
        time.sleep(max(0.0, t0 + at - time.time()))
        if kind == "gpu":
            with dask.annotate(resources={"GPU": 1}, fallback_timeout=FALLBACK_TIMEOUT):
                fs = client.map(gpu_task, range(w["burst"]), seconds=w["gpu_seconds"], pure=False)
            bursts.append((time.time(), fs))
        else:
            cpu.append(client.submit(cpu_task, k, seconds=w["cpu_seconds"], pure=False))
    results = [(at, client.gather(fs)) for at, fs in bursts]
    ran_on = client.gather(cpu)
    return {
        "t0": t0,
        "done": time.time(),
        "burst_seconds": [max(end for _, end in rs) - at for at, rs in results],
        "on_gpu": sum(dev is not None for _, rs in results for dev, _ in rs),
        "gpu_tasks": sum(len(rs) for _, rs in results),
        "cpu_tasks": len(cpu),
        "cpu_tasks_on_gpu_workers": sum(name.startswith("gpu-") for name in ran_on),
    }


def _alive(records: list[tuple[float, str, int]], start: float, end: float) -> dict[str, Any]:
    """Per pool: worker-seconds within ``[start, end]``, starts, and the alive-count steps."""
    out: dict[str, Any] = {}
    for pool in POOLS:
        alive, since, seconds, starts = 0, start, 0.0, 0
        steps = [(0.0, 0)]
        for t, name, delta in sorted(records):
            if not name.startswith(pool + "-"):
                continue
            t = min(max(t, start), end)
            seconds += alive * (t - since)
            alive, since = alive + delta, t
            starts += delta > 0 and t > start
            steps.append((round(t - start, 3), alive))
        seconds += alive * (end - since)
        steps.append((round(end - start, 3), alive))
        out[pool] = {"worker_seconds": seconds, "starts": starts, "steps": steps}
    return out


def one_run(setup: str, w: dict[str, Any]) -> dict[str, Any]:
    """The workload on a fresh cluster of ``setup``; its figures."""
    with _cluster(setup) as cluster, Client(cluster) as client:
        scaler = _start(setup, cluster, client, w)
        try:
            r = _drive(client, w)
            # the adaptive ones: until they gave back what they would, or tail s
            shrunk = None if setup == "fixed" else until_empty(client, w["tail"])
            end = r["done"] if setup == "fixed" else time.time()
            records = client.run_on_scheduler(_records)
            fell = events(client, "fallback", since=r["t0"])
            ups = events(client, "scale-up", since=r["t0"])
        finally:
            if scaler is not None:
                scaler.stop()
    pools = _alive(records, r["t0"], end)
    return {
        "setup": setup,
        "finish_seconds": r["done"] - r["t0"],
        "window_seconds": end - r["t0"],
        "shrunk": shrunk,
        "gpu_worker_seconds": pools["gpu"]["worker_seconds"],
        "cpu_worker_seconds": pools["cpu"]["worker_seconds"],
        "gpu_worker_starts": pools["gpu"]["starts"],
        "cpu_worker_starts": pools["cpu"]["starts"],
        "fallbacks": sum(int(m.get("count", 1)) for _, m in fell),
        "fallback_events": len(fell),
        "scale_up_events": len(ups),
        "gpu_tasks": r["gpu_tasks"],
        "gpu_tasks_on_gpu": r["on_gpu"],
        "cpu_tasks": r["cpu_tasks"],
        "cpu_tasks_on_gpu_workers": r["cpu_tasks_on_gpu_workers"],
        "burst_seconds": r["burst_seconds"],
        "steps": {p: pools[p]["steps"] for p in POOLS},
    }


FIGURES = ["finish_seconds", "gpu_worker_seconds", "cpu_worker_seconds", "gpu_worker_starts"]
FIGURES += ["cpu_worker_starts", "fallbacks", "gpu_tasks_on_gpu", "cpu_tasks_on_gpu_workers"]


def _plot(path: Path, runs: dict[str, list[dict[str, Any]]], summary: dict, w: dict) -> None:
    """Workers alive per pool over time (each setup's first round), burst starts dashed;
    and the median worker-seconds per setup and pool."""
    fig, axes = plt.subplots(len(SETUPS) + 1, 1, figsize=(7, 2.0 * (len(SETUPS) + 1)))
    top = max(ADAPTIVE_MAXIMUM, sum(MAXIMUM.values()))
    right = max(runs[s][0]["window_seconds"] for s in SETUPS) * 1.02
    for ax, setup in zip(axes, SETUPS, strict=False):
        first = runs[setup][0]
        for i, pool in enumerate(POOLS):
            t, n = zip(*first["steps"][pool], strict=True)
            lifted = [k + 0.06 * i for k in n]  # apart where both pools have as many
            ax.step(t, lifted, where="post", color=COLORS[i], label=f"{pool} workers")
        for b in range(w["bursts"]):
            ax.axvline(b * w["period"], color="grey", ls="--", lw=0.7)
        ax.axvline(first["finish_seconds"], color="black", lw=0.8)
        ax.set_ylim(-0.1, top + 0.3)
        ax.set_xlim(0, right)
        ax.set_ylabel("workers")
        ax.set_title(f"{setup}: workers registered (dashed: a burst; black: work done)", fontsize=9)
    axes[0].legend(fontsize=7, loc="upper right")
    axes[len(SETUPS) - 1].set_xlabel("seconds since the first submission")
    ax = axes[-1]
    width = 0.38
    for i, pool in enumerate(POOLS):
        values = [summary[s][f"{pool}_worker_seconds"]["median"] for s in SETUPS]
        xs = [k + (i - 0.5) * width for k in range(len(SETUPS))]
        ax.bar(xs, values, width, color=COLORS[i], label=f"{pool} worker-seconds")
        for x, v in zip(xs, values, strict=True):
            ax.annotate(f"{v:.0f}", (x, v), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(SETUPS)), list(SETUPS))
    ax.set_ylabel("worker-seconds (median)")
    ax.legend(fontsize=7)
    save(fig, path)


def run(quick: bool, out: Path, rounds: int | None = None) -> dict[str, Any]:
    if quick:
        w = {"bursts": 2, "burst": 4, "gpu_seconds": 0.3, "period": 5.0, "idle_after": "1s"}
        w |= {"cpu_every": 1.0, "cpu_seconds": 0.2, "tail": 10.0}
    else:
        w = {"bursts": 3, "burst": 12, "gpu_seconds": 1.0, "period": 20.0, "idle_after": "2s"}
        w |= {"cpu_every": 0.5, "cpu_seconds": 0.5, "tail": 30.0}
    n_rounds = rounds or (1 if quick else 3)
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in SETUPS}
    loads: list[list[float]] = []
    with fake_gpus(ADAPTIVE_MAXIMUM, "16GiB"):
        for r in range(n_rounds):
            for setup in SETUPS if r % 2 == 0 else SETUPS[::-1]:
                runs[setup].append(one_run(setup, w))
                loads.append([round(x, 2) for x in os.getloadavg()])
    summary = {
        s: {f: spread(x[f] for x in rs) for f in FIGURES}
        | {"burst_seconds": spread(b for x in rs for b in x["burst_seconds"])}
        for s, rs in runs.items()
    }
    _plot(out / f"{NAME}.png", runs, summary, w)
    return {
        "setup": {**w, "rounds": n_rounds, "maximum": MAXIMUM, **LOOK},
        "fallback_timeout": FALLBACK_TIMEOUT,
        "load_after_each_run": loads,
        "runs": runs,
        "summary": summary,
    }
