"""The guard's per-task work inside a worker, piece by piece.

The overhead benchmark says how much accelsched costs a tiny GPU task end to end; this
one says where it goes. One in-process worker (one thread, one simulated GPU,
``--resources GPU=1``) runs tiny ``resources={"GPU": 1}`` tasks in rounds alternating
between a cluster with ``accelsched.register`` and a plain one. Per task:

- *loop*: the guard's ``transition`` hook (worker event loop), per kind of transition
  the median call times the calls per task;
- *thread in the rounds*: the executor thread's CPU time (``thread_time``) with and
  without accelsched: the guard's work in the task's thread, noisy (two threads);
- *thread*: the guard's GPU runner called in a loop in one thread, minus the bare call;
- *pieces*: the named parts of that work, each timed around its call.

The guard's Python per GPU task is *thread* + *loop*, against :data:`BUDGET_US`.
*context*: then a CUDA context is made (as real GPU work makes one), after which the guard
measures GPU tasks (NVML process-list reads, on a sample of a quiet prefix's runs): the
same tasks in paired rounds, thread CPU per task on both sides, their paired difference
and ratio, and NVML reads per task. A timer's own cost (``timer_overhead_us``, measured
on a no-op) is taken off every figure it makes. No timing is asserted; the figures are
read (``benchmarks/README.md``). Run with ``python -m benchmarks hotpath [--rounds 5]``
(``--quick``: 100 tasks, 2 rounds); timers: :mod:`benchmarks.micro.call_timers`; report
and plot: :mod:`benchmarks.micro.hotpath_report`.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from distributed import Client, LocalCluster

import accelsched
from accelsched import internals
from accelsched.testing import create_context, fake_gpus
from benchmarks.micro import call_timers
from benchmarks.micro.hotpath_report import med as _med
from benchmarks.micro.hotpath_report import plot, report
from benchmarks.micro.hotpath_report import spread as _spread

NAME = "hotpath"

#: The guard's parts timed per call: (label, side, attribute path from the GuardPlugin).
#: A path missing from the code under test is skipped (and listed as such).
PIECES: tuple[tuple[str, str, str], ...] = (
    ("lease acquire", "thread", "binder.leases.grant"),
    ("lease release", "thread", "binder.leases.release"),
    ("measurement plan", "thread", "binder.ledger.plan"),
    ("ledger before (NVML base)", "thread", "binder.ledger.take_base"),
    ("ledger after (NVML close)", "thread", "binder.ledger.after"),
    ("no-context check after", "thread", "binder.ledger.unmeasured"),
    ("NVML process read", "thread", "inventory.monitor.process_memory"),
    ("pool check", "thread", "binder.pools.after_gpu_task"),
    ("choose a runner", "loop", "binder.route"),
    ("live results", "loop", "ledger.entered"),
    ("released", "loop", "ledger.released"),
    ("running count, start", "loop", "binder.leases.started"),
    ("running count, end", "loop", "binder.leases.ended"),
)
#: What the guard's work per GPU task may cost, inside the worker (issue 19).
BUDGET_US = 30.0


def tiny(i: int) -> int:
    return i + 1


@contextlib.contextmanager
def _cluster(acc: bool) -> Iterator[tuple[Client, Any]]:
    with (
        LocalCluster(
            processes=False,
            n_workers=1,
            threads_per_worker=1,
            resources={"GPU": 1},
            dashboard_address=":0",  # None is distributed's default, 8787: maybe taken
        ) as cluster,
        Client(cluster) as client,
    ):
        worker = next(iter(cluster.workers.values()))
        if acc:
            accelsched.register(client)
            deadline = time.monotonic() + 30
            while worker.state.total_resources.get("GPU", 0) < 1 or not all(
                w.get("resources", {}).get("GPU", 0) >= 1  # as the scheduler places by it
                for w in internals.workers_listed(client).values()
            ):
                if time.monotonic() > deadline:
                    raise RuntimeError("the worker's GPU was not verified")
                time.sleep(0.05)
        yield client, worker


def make_context() -> int:
    """A (simulated) CUDA context of this process on its task's device."""
    create_context(accelsched.current_device() or 0)
    return 0


def _context_rounds(
    clusters: dict[str, tuple[Client, Any]], tasks: int, rounds: int, timer: dict[str, float]
) -> dict[str, Any]:
    """Paired rounds of tiny GPU tasks after a context was made: thread CPU per task on
    both sides and NVML reads per task with accelsched."""
    for client, _ in clusters.values():
        client.submit(make_context, resources={"GPU": 1}, pure=False).result()
        _run(client, min(300, tasks))  # warm up: the sampler backs off as it would
    rows: dict[str, list[float]] = {"plain": [], "accelsched": []}
    reads: list[float] = []
    for r in range(rounds):
        order = ["plain", "accelsched"] if r % 2 == 0 else ["accelsched", "plain"]
        for name in order:
            client, worker = clusters[name]
            got = _round(client, worker, tasks, name == "accelsched", timer, False)
            rows[name].append(got["thread_cpu_us"])
        client, worker = clusters["accelsched"]
        got = _round(client, worker, tasks, True, timer, True)
        read = got["pieces"].get("NVML process read")
        reads.append(read["calls_per_task"] if read else float("nan"))
    pairs = list(zip(rows["plain"], rows["accelsched"], strict=True))
    return {
        "thread_cpu_us": {k: _med(v) for k, v in rows.items()},
        "thread_delta_us": _spread([a - p for p, a in pairs]),
        "thread_ratio": _spread([a / p for p, a in pairs]),
        "nvml_reads_per_task": _med(reads),
        "rounds_detail": rows,
    }


def _run(client: Client, n: int) -> None:
    client.gather(client.map(tiny, range(n), pure=False, resources={"GPU": 1}))


def _round(
    client: Client, worker: Any, n: int, acc: bool, timer: dict[str, float], timed: bool
) -> dict[str, Any]:
    """One round of ``n`` tasks: the executor thread's CPU per task and, with accelsched,
    the hook's; ``timed``: each piece timed too (its timers add to the thread's CPU)."""
    guard = worker.plugins.get(accelsched.GuardPlugin.name) if acc else None
    out: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        cpu = stack.enter_context(call_timers.thread_cpu(worker))
        hook = (
            stack.enter_context(call_timers.timed(guard, "transition", kind=call_timers.HookTimer))
            if guard is not None
            else None
        )
        pieces = {
            label: stack.enter_context(call_timers.timed(guard, path))
            for label, _, path in PIECES
            if guard is not None and timed
        }
        gen0 = gc.get_stats()[0]["collections"]
        _run(client, n)
        out["gc_gen0_per_1000_tasks"] = (gc.get_stats()[0]["collections"] - gen0) * 1000 / n
    out["thread_cpu_us"] = _med([c / 1e3 for c in cpu])
    if hook is not None:
        # per kind of transition, median call x calls: a preemption by the executor
        # thread (the GIL) or a GC pass inside one call is not the hook's cost
        kinds = {
            k: {
                "calls_per_task": round(len(ns) / n, 3),
                "median_us": round((statistics.median(ns) - timer["wall"]) / 1e3, 2),
            }
            for k, ns in hook.kinds.items()
        }
        out["loop_kinds"] = kinds
        out["loop_us"] = round(sum(v["calls_per_task"] * v["median_us"] for v in kinds.values()), 2)
        out["loop_calls_per_task"] = round(sum(len(ns) for ns in hook.kinds.values()) / n, 2)
    if pieces:
        out["pieces"] = {
            label: (
                None
                if t is None
                else {
                    "median_us": _med([(x - timer["wall"]) / 1e3 for x in t.ns]),
                    "calls_per_task": round(len(t.ns) / n, 3),
                    # median x calls: a GIL wait or a GC pass inside one call is not
                    # the piece's cost
                    "us_per_task": round(
                        (statistics.median(t.ns) - timer["wall"]) / 1e3 * len(t.ns) / n
                        if t.ns
                        else 0.0,
                        2,
                    ),
                }
            )
            for label, t in pieces.items()
        }
    return out


def _runner_alone(guard: Any, n: int) -> dict[str, float]:
    """The guard's GPU runner called in a loop in this thread (the worker idle): its own
    cost around a task, without the executor's or the event loop's noise beside it."""
    from dask._task_spec import Task

    spec = Task("tiny-alone", tiny, 1)
    make = guard.binder.gpu_runner
    # the task's prefix, where the runner takes one (it did not always)
    extra = ("tiny",) if "prefix" in inspect.signature(make).parameters else ()
    bare, wrapped = [], []
    for i in range(n):
        t0 = time.perf_counter_ns()
        spec({})
        bare.append(time.perf_counter_ns() - t0)
        runner = make(f"tiny-alone-{i}", 1, *extra)
        t0 = time.perf_counter_ns()
        runner(spec, {})
        wrapped.append(time.perf_counter_ns() - t0)
    b, w = statistics.median(bare) / 1e3, statistics.median(wrapped) / 1e3
    calls = call_timers.calls_per_call(lambda i: make(f"tiny-c-{i}", 1, *extra)(spec, {}), n)
    calls -= call_timers.calls_per_call(lambda i: spec({}), n)  # the task's own calls
    out = {"bare_us": round(b, 2), "runner_us": round(w, 2), "guard_us": round(w - b, 2)}
    return {**out, "calls": round(calls, 1)}  # the runner's function calls a task


def measure(tasks: int, rounds: int) -> dict[str, Any]:
    rows: dict[str, list[dict]] = {"plain": [], "accelsched": [], "pieces": []}
    timer = {"wall": call_timers.timer_ns(time.perf_counter_ns)}
    with fake_gpus(count=1), _cluster(False) as plain, _cluster(True) as acc:
        clusters = {"plain": plain, "accelsched": acc}
        for client, _ in clusters.values():
            _run(client, min(300, tasks))  # warm up: imports, first runs sampled
        for r in range(rounds):
            order = ["plain", "accelsched"] if r % 2 == 0 else ["accelsched", "plain"]
            for name in order:
                client, worker = clusters[name]
                rows[name].append(_round(client, worker, tasks, name == "accelsched", timer, False))
            # the pieces, in a round of their own
            client, worker = acc
            rows["pieces"].append(_round(client, worker, tasks, True, timer, True))
        guard = acc[1].plugins[accelsched.GuardPlugin.name]
        alone = _runner_alone(guard, tasks)
        hook_calls = call_timers.calls_inside(guard, "transition", lambda: _run(acc[0], 500), 500)
        # last: a context in the process stays for good
        context = _context_rounds(clusters, tasks, rounds, timer)
        context["runner_alone"] = _runner_alone(guard, tasks)
        context["hook_calls"] = call_timers.calls_inside(
            guard, "transition", lambda: _run(acc[0], 500), 500
        )
    acc_rows, plain_rows = rows["accelsched"], rows["plain"]
    pairs = zip(plain_rows, acc_rows, strict=True)
    guard_thread = [a["thread_cpu_us"] - p["thread_cpu_us"] for p, a in pairs]
    loop = [a["loop_us"] for a in acc_rows]
    pieces: dict[str, Any] = {}
    for label, side, _ in PIECES:
        per_round = [a["pieces"][label] for a in rows["pieces"] if a["pieces"].get(label)]
        pieces[label] = (
            {
                "side": side,
                "median_us": _med([p["median_us"] for p in per_round]),
                "calls_per_task": _med([p["calls_per_task"] for p in per_round]),
                "us_per_task": _med([p["us_per_task"] for p in per_round]),
            }
            if per_round
            else {"side": side, "absent": True}
        )
    kinds: dict[str, Any] = {}
    for k in sorted({k for a in acc_rows for k in a["loop_kinds"]}):
        seen = [a["loop_kinds"][k] for a in acc_rows if k in a["loop_kinds"]]
        kinds[k] = {f: _med([v[f] for v in seen]) for f in ("calls_per_task", "median_us")}
    return {
        "tasks": tasks,
        "rounds": rounds,
        # the guard's Python per task: its runner (alone, in a loop) and its hook
        "guard_us_per_task": {
            "total": round(alone["guard_us"] + _med(loop), 2),
            "thread": alone["guard_us"],
            "loop": _med(loop),
            "budget": BUDGET_US,
        },
        # the executor thread's CPU in the rounds, accelsched minus plain: cache misses
        # and the rest of sharing the process included, and the noise of two threads
        "thread_delta_in_rounds_us": _spread(guard_thread),
        "loop_kinds": kinds,
        "thread_cpu_us": {
            "plain": _med([p["thread_cpu_us"] for p in plain_rows]),
            "accelsched": _med([a["thread_cpu_us"] for a in acc_rows]),
        },
        "loop_calls_per_task": _med([a["loop_calls_per_task"] for a in acc_rows]),
        "hook_function_calls": hook_calls,  # per task, its own calls included
        "gc_gen0_per_1000_tasks": {
            "plain": _med([p["gc_gen0_per_1000_tasks"] for p in plain_rows]),
            "accelsched": _med([a["gc_gen0_per_1000_tasks"] for a in acc_rows]),
        },
        "runner_alone": alone,
        "context": context,
        "pieces": pieces,
        "timer_overhead_us": {k: round(v / 1e3, 3) for k, v in timer.items()},
        "rounds_detail": rows,
    }


def run(quick: bool, out: Path, rounds: int | None = None) -> dict[str, Any]:
    """``rounds`` paired rounds (``--rounds``; default 5, 2 with ``--quick``) of 2000 tasks
    (100 with ``--quick``)."""
    out.mkdir(parents=True, exist_ok=True)
    tasks, default_rounds = (100, 2) if quick else (2000, 5)
    result = measure(tasks, rounds or default_rounds)
    print(report(result))
    result["plots"] = [p.name for p in plot(result, out)]
    return result
