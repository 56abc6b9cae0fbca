"""Soak: a mixed GPU workload on CLI processes under random faults; no task may be stuck.

A ``dask scheduler --preload accelsched``, five ``dask worker`` nannies (an 80 GiB H100,
two 40 GiB A100s, a 24 GiB L4, two 16 GiB T4s joining late, and a CPU-only worker: see
:mod:`benchmarks.studies.soak_cluster`) and this process as the client, submitting for
``duration`` seconds a continuous mix, each task holding simulated device memory for a
moment: plain ``resources={"GPU": 1}`` tasks, ``@gpu(memory=...)`` tasks of 2 to 60 GiB
(packed), model and capability requirements, ``dual`` steps with short fallback timeouts,
two-device tasks, tasks that leak (so the guard restarts workers), tasks on results held
for a while, then released. Meanwhile faults drawn from ``seed`` strike at random times:
worker processes SIGKILLed, workers leaving and new ones joining, devices failing NVML,
``client.restart_workers``.

When the load stops the faults stop (devices recovered, workers back), and every task
must end (a result, or an expected error: out of device memory beside a leak, a worker
killed under it too often) within ``bound`` seconds. One still waiting or processing is
*stuck*: its key, state, restrictions and worker are printed and recorded, and the run's
``errors`` make ``python -m benchmarks soak`` exit 1. Figures: tasks by kind and outcome,
tasks per worker, waits, fallbacks, leaks and restarts (accelsched's events), faults.

``--duration S`` (default 600), ``--seed N``; ``--quick``: 50 s, fewer tasks in flight.
"""

from __future__ import annotations

import random
import tempfile
import time
from collections import Counter
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import dask
from distributed import Client, Future, get_worker

import accelsched
from accelsched.testing import device_alloc, fake_gpus
from benchmarks.harness.plots import bars
from benchmarks.harness.results import spread
from benchmarks.studies.soak_cluster import Cluster, Faults
from benchmarks.studies.soak_plan import DEVICES, WORKERS, plan
from benchmarks.studies.soak_report import events, keep_logs, p99, stuck_tasks

NAME = "soak"
GIB = 2**30
#: Errors a task may end with here: out of device memory (a neighbour leaked before its
#: restart), or killed with its worker too often (distributed's ``allowed-failures``).
EXPECTED = ("OutOfDeviceMemory", "KilledWorker")


def work(nbytes: int, seconds: float) -> tuple[str, float, str]:
    """Hold ``nbytes`` on the task's device (none on a CPU) for ``seconds``."""
    start = time.time()
    buf = device_alloc(nbytes) if nbytes and accelsched.current_device() is not None else None
    time.sleep(seconds)
    del buf
    return get_worker().name, start, "gpu" if accelsched.current_device() is not None else "cpu"


def leak(nbytes: int, seconds: float) -> tuple[str, float, str]:
    """Leak ``nbytes`` on the task's device: the guard finds it and restarts the worker."""
    start = time.time()
    device_alloc(nbytes, leak=True)
    time.sleep(seconds)
    return get_worker().name, start, "gpu"


def on_held(held: Any, nbytes: int, seconds: float) -> tuple[str, float, str]:
    return work(nbytes, seconds)


#: Each kind: the callable, the device memory it holds, whether it is annotated with
#: ``resources={"GPU": 1}``, and how often it is drawn against the others. "cpu" tasks
#: ask for no GPU (they may run anywhere).
KINDS: dict[str, tuple[Any, int, bool, int]] = {
    "cpu": (work, 0, False, 2),
    "plain": (work, 1 * GIB, True, 4),
    "declared-2GiB": (accelsched.gpu(memory="2GiB")(work), 2 * GIB, False, 8),
    "declared-12GiB": (accelsched.gpu(memory="12GiB")(work), 12 * GIB, False, 3),
    "declared-30GiB": (accelsched.gpu(memory="30GiB")(work), 30 * GIB, False, 2),
    "declared-60GiB": (accelsched.gpu(memory="60GiB")(work), 60 * GIB, False, 1),
    "model-A100": (accelsched.gpu(model="*A100*")(work), 4 * GIB, False, 2),
    "capability-8.9": (accelsched.gpu(capability="8.9")(work), 4 * GIB, False, 2),
    "dual": (accelsched.dual(work, work, fallback_timeout="1s"), 2 * GIB, False, 3),
    "dual-20GiB": (
        accelsched.dual(work, work, fallback_timeout="3s", memory="20GiB"),
        20 * GIB,
        False,
        2,
    ),
    "whole-device": (accelsched.gpu(work), 8 * GIB, False, 2),
    "two-devices": (accelsched.gpu(count=2)(work), 4 * GIB, False, 1),
    "leak": (accelsched.gpu(leak), 6 * GIB, False, 1),
    "on-held": (accelsched.gpu(memory="2GiB")(on_held), 2 * GIB, False, 2),
}


class Load:
    """The client side: submits the mix, keeps some results a while, records outcomes."""

    def __init__(self, client: Client, rng: random.Random, in_flight: int) -> None:
        self.client, self.rng, self.in_flight = client, rng, in_flight
        self.pending: dict[str, tuple[Future, str, float]] = {}
        self.held: list[tuple[float, Future]] = []
        self.outcomes: Counter[tuple[str, str]] = Counter()
        self.per_worker: Counter[str] = Counter()
        self.waits: list[float] = []  # submitted -> its (last) start on a worker
        self.by_kind: dict[str, list[float]] = {}  # the same, per kind
        self.slowest: list[tuple[float, str, str, float]] = []  # wait, key, worker, submitted
        self.latencies: list[float] = []  # submitted -> seen ended here (0.1 s steps)
        self.submitted = 0
        self.errors: Counter[str] = Counter()

    def submit(self) -> None:
        names = list(KINDS)
        while len(self.pending) < self.in_flight:
            kind = self.rng.choices(names, weights=[KINDS[n][3] for n in names])[0]
            fn, nbytes, annotate, _ = KINDS[kind]
            seconds = self.rng.uniform(0.05, 0.8)
            args: tuple[Any, ...] = (nbytes, seconds)
            if kind == "on-held":
                if not self.held:
                    continue
                args = (self.rng.choice(self.held)[1], *args)
            with dask.annotate(resources={"GPU": 1}) if annotate else nullcontext():
                future = self.client.submit(fn, *args, pure=False, key=f"{kind}-{self.submitted}")
            self.pending[str(future.key)] = (future, kind, time.time())
            self.submitted += 1

    def collect(self, hold: bool = True) -> None:
        now = time.time()
        for key, (future, kind, submitted) in list(self.pending.items()):
            if not future.done():
                continue
            del self.pending[key]
            self.latencies.append(now - submitted)
            if future.status == "finished":
                worker, start, where = future.result()
                self.outcomes[(kind, f"finished-{where}")] += 1
                self.per_worker[worker] += 1
                self.waits.append(start - submitted)
                self.by_kind.setdefault(kind, []).append(start - submitted)
                self.slowest = sorted([*self.slowest, (start - submitted, key, worker, submitted)])
                self.slowest = self.slowest[-15:]
                if hold and self.rng.random() < 0.15:
                    self.held.append((now + self.rng.uniform(5, 30), future))
            else:
                error = type(future.exception()).__name__ if future.status == "error" else None
                self.outcomes[(kind, error or str(future.status))] += 1
                if error not in EXPECTED:
                    self.errors[f"{kind}: {error or future.status}"] += 1
        self.held = [(t, f) for t, f in self.held if t > now]  # the rest released


def run(
    quick: bool, out: Path, duration: int | None = None, seed: int | None = None
) -> dict[str, Any]:
    duration = duration or (50 if quick else 600)
    seed = 2026 if seed is None else seed
    faults = plan(seed, duration, max(6, round(duration * 44 / 600)))
    in_flight, bound = (16, 90) if quick else (40, 180)
    print(f"soak: {duration} s, seed {seed}, {len(faults)} faults planned:", flush=True)
    for fault in faults:
        print(f"  {fault}", flush=True)
    names, memory, capability = zip(*DEVICES, strict=True)
    with (
        tempfile.TemporaryDirectory(prefix="soak-") as tmp,
        fake_gpus(len(DEVICES), list(memory), names=list(names), capability=list(capability),
                  context_memory="256MiB") as gpus,
    ):  # fmt: skip
        cluster = Cluster(Path(tmp))
        figures: dict[str, Any] | None = None
        try:
            file = cluster.start_scheduler()
            for spec in WORKERS:
                if not spec.late:
                    cluster.start_worker(spec)
            with Client(scheduler_file=file, timeout="60s") as client:
                client.wait_for_workers(len(WORKERS) - 1, timeout=120)
                figures = _soak(client, cluster, gpus, faults, seed, duration, in_flight, bound)
        finally:
            cluster.close()
            if figures is None or figures.get("errors"):
                keep_logs(Path(tmp), out)
    _plot(out, figures)
    return figures


def _soak(
    client: Client, cluster: Cluster, gpus: Any, faults: list, seed: int, duration: int,
    in_flight: int, bound: int,
) -> dict[str, Any]:  # fmt: skip
    load = Load(client, random.Random(seed + 1), in_flight)
    start = time.time()
    injector = Faults(cluster, gpus, client, faults, start)
    injector.start()
    seen: dict[str, Any] = {}  # tasks waiting past a third of the bound, as seen then
    while time.time() - start < duration:
        load.submit()
        load.collect()
        injector.supervise()
        time.sleep(0.1)
        now = time.time()
        late = [k for k, (_, _, t) in load.pending.items() if now - t > bound / 3]
        if late and len(seen) < 10 and not set(late) <= set(seen):
            new = sorted(set(late) - set(seen))[: 10 - len(seen)]
            for key, entry in stuck_tasks(client, new).items():
                seen[key] = {"at_s": now - start, **entry}
                print(
                    f"soak: waiting {bound / 3:.0f} s+ at {now - start:.0f} s: {key}: {entry}",
                    flush=True,
                )
    by_kind = injector.finish()
    print(f"soak: load stopped at {time.time() - start:.0f} s, {len(load.pending)} tasks "
          f"left, faults {dict(by_kind)}", flush=True)  # fmt: skip
    stopped = time.time()
    while load.pending and time.time() - stopped < bound:
        load.collect(hold=False)
        injector.supervise()
        time.sleep(0.2)
    drained = time.time() - stopped
    stuck = stuck_tasks(client, sorted(load.pending)) if load.pending else {}
    for key, entry in stuck.items():
        print(f"soak: STUCK {key}: {entry}", flush=True)
    errors = [f"stuck after {bound} s: {key} ({e['state']})" for key, e in stuck.items()]
    # a task that waited longer than the bound while the load ran was stuck as well:
    # only the load's end (or a fault) let it start
    stranded = [(w, k, wk) for w, k, wk, _ in load.slowest if w > bound]
    errors += [f"waited {w:.0f} s (> {bound} s) under load: {k} on {wk}" for w, k, wk in stranded]
    errors += [f"unexpected error x{n}: {what}" for what, n in load.errors.items()]
    outcomes: dict[str, dict[str, int]] = {}
    for (kind, outcome), n in sorted(load.outcomes.items()):
        outcomes.setdefault(kind, {})[outcome] = n
    waits = {**spread(load.waits), "p99": p99(load.waits)}
    figures: dict[str, Any] = {
        "setup": {
            "duration_s": duration,
            "seed": seed,
            "in_flight": in_flight,
            "bound_s": bound,
            "workers": {s.name: s.devices or "cpu" for s in WORKERS},
            "devices": [f"{n} {m // GIB} GiB" for n, m, _ in DEVICES],
        },
        "faults": {"planned": len(faults), "by_kind": dict(by_kind), "done": injector.done},
        "worker_exits": injector.exits,  # started again at once, as a supervisor would
        "tasks": {
            "submitted": load.submitted,
            "ended": load.submitted - len(load.pending),
            "outcomes": outcomes,
            "per_worker": dict(load.per_worker),
        },
        "wait_s": waits,
        "latency_s": {**spread(load.latencies), "p99": p99(load.latencies)},
        "wait_by_kind_s": {
            k: {**spread(w), "p99": p99(w)} for k, w in sorted(load.by_kind.items())
        },
        "slowest": [  # the longest waits: which task, where it ran, when it was submitted
            {"key": k, "wait_s": w, "worker": wk, "submitted_at_s": t - start}
            for w, k, wk, t in reversed(load.slowest)
        ],
        "drained_s": drained,
        "events": events(client),
        "stuck": stuck,
        "stranded": len([w for w in load.waits if w > bound]),
        "seen_waiting": seen,
    }
    print(f"soak: {load.submitted} tasks, {len(stuck)} stuck, max wait "
          f"{waits['max']:.1f} s, events {figures['events']}", flush=True)  # fmt: skip
    return {**figures, **({"errors": errors} if errors else {})}


def _plot(out: Path, figures: dict[str, Any]) -> None:
    bars(
        out / f"{NAME}_per_worker.png",
        figures["tasks"]["per_worker"],
        ylabel="tasks finished",
        title=f"{figures['tasks']['submitted']} tasks, {len(figures['faults']['done'])} faults, "
        f"{len(figures['stuck'])} stuck",
    )
