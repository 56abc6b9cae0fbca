"""The guard's per-task work inside a worker, piece by piece: ``python -m benchmarks hotpath``.

The overhead benchmark says how much accelsched costs a tiny GPU task end to end; this
one says where it goes, so that the next change adding to the hot path shows up. One
in-process worker (``LocalCluster(processes=False)``, one thread, one simulated GPU,
``--resources GPU=1``) runs tiny tasks asking for ``resources={"GPU": 1}``, in rounds
alternating between a cluster with ``accelsched.register`` and a plain one. Per task:

- *loop*: the guard's ``transition`` hook, every call the task's transitions make
  (worker event loop), timed around the hook: per kind of transition, the median call
  times the calls per task;
- *thread in the rounds*: the CPU time (``thread_time``) of the executor thread running
  the task (distributed's own wrapping included), with and without accelsched: the
  difference is the guard's work in the task's thread as it runs there, cache misses
  included, but two threads make it noisy (tens of µs from round to round);
- *thread*: the guard's GPU runner called in a loop in one thread, the worker idle,
  minus the bare task call: the thread-side cost without the noise of two threads.

The guard's Python per GPU task is *thread* + *loop*, against :data:`BUDGET_US`.
- *pieces*: the named parts of that work, each timed around its call (median per call
  and calls per task).

What a timer adds to what it times (measured on a no-op, ``timer_overhead_us``) is
taken off every figure it makes.

No timing is asserted anywhere; the figures are read (``benchmarks/README.md``).

Usage::

    python -m benchmarks hotpath [--quick]
    python -m benchmarks.bench_hotpath [--tasks 2000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from distributed import Client, LocalCluster

import accelsched
from accelsched.testing import fake_gpus

NAME = "hotpath"

#: The guard's parts timed per call: (label, side, attribute path from the GuardPlugin).
#: A path missing from the code under test is skipped (and listed as such).
PIECES: tuple[tuple[str, str, str], ...] = (
    ("lease acquire", "thread", "binder.leases.acquire"),
    ("lease release", "thread", "binder.leases.release"),
    ("measurement plan", "thread", "binder.ledger.plan"),
    ("ledger before (NVML base)", "thread", "binder.ledger.before"),
    ("ledger after (NVML close)", "thread", "binder.ledger.after"),
    ("no-context check after", "thread", "binder.ledger.unmeasured"),
    ("NVML process read", "thread", "inventory.monitor.process_memory"),
    ("pool check", "thread", "binder.pools.after_gpu_task"),
    ("choose a runner", "loop", "_runner"),
    ("live results", "loop", "leaks.live.stored"),
    ("released", "loop", "leaks.live.released"),
    ("running count, start", "loop", "running.started"),
    ("running count, end", "loop", "running.ended"),
)
#: What the guard's work per GPU task may cost, inside the worker (issue 19).
BUDGET_US = 30.0


def tiny(i: int) -> int:
    return i + 1


class _Timer:
    """Wraps one callable: the ns of each call (``clock``: perf_counter_ns, or
    thread_time_ns where a preemption must not count)."""

    def __init__(self, fn: Callable[..., Any], clock: Callable[[], int]) -> None:
        self.fn = fn
        self.clock = clock
        self.ns: list[int] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        clock = self.clock
        t0 = clock()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.ns.append(clock() - t0)


class _HookTimer(_Timer):
    """Times the transition hook per kind of transition (``start -> finish``)."""

    def __init__(self, fn: Callable[..., Any], clock: Callable[[], int]) -> None:
        super().__init__(fn, clock)
        self.kinds: dict[str, list[int]] = {}

    def __call__(self, key: Any, start: str, finish: str, **kwargs: Any) -> Any:
        t0 = time.perf_counter_ns()
        try:
            return self.fn(key, start, finish, **kwargs)
        finally:
            self.kinds.setdefault(f"{start}->{finish}", []).append(time.perf_counter_ns() - t0)


def _timer_ns(clock: Callable[[], int], n: int = 20000) -> float:
    """What a :class:`_Timer` adds to what it times (median over a no-op): subtracted."""
    timer = _Timer(lambda *args, **kwargs: None, clock)
    for _ in range(n):
        timer("key", "start", "finish")
    return float(statistics.median(timer.ns))


def _resolve(root: Any, path: str) -> tuple[Any, str] | None:
    *owners, attr = path.split(".")
    obj = root
    for name in owners:
        obj = getattr(obj, name, None)
        if obj is None:
            return None
    return (obj, attr) if callable(getattr(obj, attr, None)) else None


@contextlib.contextmanager
def _timed(
    root: Any,
    path: str,
    clock: Callable[[], int] = time.perf_counter_ns,
    kind: type[_Timer] = _Timer,
) -> Iterator[Any]:
    """Time ``root.<path>`` (set on its owner instance) for the block's duration."""
    found = _resolve(root, path)
    if found is None:
        yield None
        return
    owner, attr = found
    had = attr in getattr(owner, "__dict__", {})
    timer = kind(getattr(owner, attr), clock)
    setattr(owner, attr, timer)
    try:
        yield timer
    finally:
        if had:
            setattr(owner, attr, timer.fn)
        else:
            delattr(owner, attr)


@contextlib.contextmanager
def _thread_cpu(worker: Any) -> Iterator[list[int]]:
    """The executor thread's CPU ns per task run through the worker's default executor."""
    executor = worker.executors["default"]
    submit = executor.submit
    cpu: list[int] = []

    def timed_submit(fn: Callable[[], Any], *args: Any, **kwargs: Any) -> Any:
        def timed() -> Any:
            t0 = time.thread_time_ns()
            try:
                return fn()
            finally:
                cpu.append(time.thread_time_ns() - t0)

        return submit(timed, *args, **kwargs)

    executor.submit = timed_submit
    try:
        yield cpu
    finally:
        del executor.submit


@contextlib.contextmanager
def _cluster(acc: bool) -> Iterator[tuple[Client, Any]]:
    with (
        LocalCluster(
            processes=False,
            n_workers=1,
            threads_per_worker=1,
            resources={"GPU": 1},
            dashboard_address=None,
        ) as cluster,
        Client(cluster) as client,
    ):
        worker = next(iter(cluster.workers.values()))
        if acc:
            accelsched.register(client)
            deadline = time.monotonic() + 30
            while worker.state.total_resources.get("GPU", 0) < 1 or not _verified(client):
                if time.monotonic() > deadline:
                    raise RuntimeError("the worker's GPU was not verified")
                time.sleep(0.05)
        yield client, worker


def _verified(client: Client) -> bool:
    workers = client.scheduler_info()["workers"].values()
    return all(w.get("resources", {}).get("GPU", 0) >= 1 for w in workers)


def _run(client: Client, n: int) -> None:
    client.gather(client.map(tiny, range(n), pure=False, resources={"GPU": 1}))


def _med(values: list[float]) -> float:
    return round(statistics.median(values), 2) if values else float("nan")


def _round(
    client: Client, worker: Any, n: int, acc: bool, timer: dict[str, float], timed: bool
) -> dict[str, Any]:
    """One round of ``n`` tasks: the executor thread's CPU per task and, with accelsched,
    the hook's; ``timed``: each piece timed too (its timers add to the thread's CPU)."""
    guard = worker.plugins.get(accelsched.GuardPlugin.name) if acc else None
    out: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        cpu = stack.enter_context(_thread_cpu(worker))
        hook = (
            stack.enter_context(_timed(guard, "transition", kind=_HookTimer))
            if guard is not None
            else None
        )
        pieces = {
            label: stack.enter_context(_timed(guard, path))
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
    return {"bare_us": round(b, 2), "runner_us": round(w, 2), "guard_us": round(w - b, 2)}


def measure(tasks: int, rounds: int) -> dict[str, Any]:
    rows: dict[str, list[dict]] = {"plain": [], "accelsched": [], "pieces": []}
    timer = {"wall": _timer_ns(time.perf_counter_ns)}
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
        "gc_gen0_per_1000_tasks": {
            "plain": _med([p["gc_gen0_per_1000_tasks"] for p in plain_rows]),
            "accelsched": _med([a["gc_gen0_per_1000_tasks"] for a in acc_rows]),
        },
        "runner_alone": alone,
        "pieces": pieces,
        "timer_overhead_us": {k: round(v / 1e3, 3) for k, v in timer.items()},
        "rounds_detail": rows,
    }


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": _med(values), "min": round(min(values), 2), "max": round(max(values), 2)}


def report(result: dict[str, Any]) -> str:
    g, alone = result["guard_us_per_task"], result["runner_alone"]
    lines = [
        f"{result['tasks']} tiny GPU tasks x {result['rounds']} rounds, one in-process worker",
        f"guard per task: {g['total']} us (budget {g['budget']:g}): thread {g['thread']} us "
        f"(the runner alone, {alone['runner_us']} - {alone['bare_us']} bare) + loop "
        f"{g['loop']} us ({result['loop_calls_per_task']} hook calls)",
        f"executor thread CPU per task in the rounds: {result['thread_cpu_us']}, "
        f"accelsched - plain {result['thread_delta_in_rounds_us']}",
        f"gc gen0 per 1000 tasks (whole process): {result['gc_gen0_per_1000_tasks']}",
        "hook per transition: "
        + ", ".join(
            f"{k} {v['median_us']} us x {v['calls_per_task']}"
            for k, v in result["loop_kinds"].items()
        ),
    ]
    for label, p in result["pieces"].items():
        if p.get("absent"):
            lines.append(f"  {label:26s} ({p['side']}) absent")
        else:
            lines.append(
                f"  {label:26s} ({p['side']:6s}) {p['us_per_task']:7.2f} us/task "
                f"({p['calls_per_task']} calls, {p['median_us']} us each)"
            )
    return "\n".join(lines)


def plot(result: dict[str, Any], out: Path) -> list[Path]:
    """The pieces' µs per task, by side, against the budget."""
    from benchmarks.plots import plt, save  # the Agg backend, as every benchmark draws

    present = [(k, p) for k, p in result["pieces"].items() if not p.get("absent")]
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(present) + 1.6))
    labels = [f"{k} ({p['side']})" for k, p in present]
    ax.barh(labels, [p["us_per_task"] for _, p in present], color="tab:blue")
    g = result["guard_us_per_task"]
    ax.set_xlabel("µs per GPU task (median call × calls per task)")
    ax.set_title(
        f"guard per task {g['total']} µs (budget {BUDGET_US:g}): "
        f"runner {g['thread']} + hook {g['loop']}",
        fontsize=10,
    )
    ax.invert_yaxis()
    return [save(fig, out / f"{NAME}.png", dpi=100)]


def run(quick: bool, out: Path) -> dict[str, Any]:
    """The entry point's hook: ``--quick`` runs 100 tasks, 2 rounds."""
    out.mkdir(parents=True, exist_ok=True)
    tasks, rounds = (100, 2) if quick else (2000, 5)
    result = measure(tasks, rounds)
    print(report(result))
    result["plots"] = [p.name for p in plot(result, out)]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print(report(measure(args.tasks, args.rounds)))


if __name__ == "__main__":
    main()
