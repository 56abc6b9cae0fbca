"""The four ways of living with leaking GPU tasks that the leak benchmark compares.

(a) ``none``: plain distributed; leaked memory stays until the device is full.
(b) ``per-task``: a fresh worker process after every GPU task, as Ray does by default for
    GPU tasks (``max_calls=1``). With what distributed offers a user, the cheapest
    faithful emulation is a driver per worker: submit one task pinned to the worker,
    take its result to the client (Ray keeps results in its object store, outside the
    worker), then ``client.restart_workers([name])`` through the nanny.
(c) ``lifetime``: distributed's worker lifetime (``lifetime``, ``lifetime_stagger``,
    ``lifetime_restart=True``, as ``--lifetime``/``--lifetime-restart`` on the CLI): each
    worker closes gracefully every T s (± stagger) and its nanny starts a new process.
(d) ``accelsched``: ``accelsched.register(...)``; the guard restarts only a worker whose
    device memory is confirmed leaked, after moving its results to a peer.

Each returns a :class:`PolicyRun` with the same figures, measured the same way.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import dask
from distributed import Client, Future, as_completed
from distributed import wait as wait_futures

import accelsched
from benchmarks.harness.clusters import events, gpu_cluster, gpus_ready, settled, wait
from benchmarks.harness.sampling import MemorySampler
from benchmarks.studies.workload import gpu_task


@dataclass(frozen=True)
class Setup:
    """One leak-benchmark configuration (all sizes in bytes)."""

    tasks: int  # tasks per run of (a), (c), (d)
    per_task_tasks: int  # tasks per run of (b): a process start each, so fewer
    leak_every: int  # one task in this many leaks
    leak: int
    temp: int  # working memory of every task
    seconds: float  # compute time of every task
    memory: int  # each simulated GPU's total: the hard limit
    context: int  # what a CUDA context costs a process
    threshold: int  # accelsched's leak_threshold
    lifetimes: tuple[float, ...]  # T values for (c)
    rounds: int


@dataclass
class PolicyRun:
    """What one policy did with one batch of tasks."""

    policy: str
    tasks: int
    window: int | None = None  # tasks in flight at once; None: all submitted together
    wall_s: float = 0.0
    finished: int = 0
    oom_failed: int = 0
    other_failed: int = 0
    recomputed: int = 0
    restarts: int = 0
    wrong: int = 0
    peak_bytes: list[int] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)  # failures by exception type
    trace: dict[str, Any] = field(default_factory=dict)

    @property
    def throughput(self) -> float:
        """Tasks finished per second of wall time (submission to the last result)."""
        return self.finished / self.wall_s if self.wall_s else 0.0

    @property
    def results_lost(self) -> int:
        """Results computed and then lost (recomputed), plus tasks failed by anything but OOM."""
        return self.recomputed + self.other_failed

    def as_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k != "trace"}
        out.update(throughput=self.throughput, results_lost=self.results_lost)
        return out


def _task_kwargs(setup: Setup, log: Path) -> dict[str, Any]:
    return {
        "leak_every": setup.leak_every,
        "leak": setup.leak,
        "temp": setup.temp,
        "seconds": setup.seconds,
        "log": str(log),
    }


def _classify(run: PolicyRun, outcomes: dict[int, Any], log: Path) -> None:
    """Count finished, OOM-failed and otherwise failed tasks, and recomputed results."""
    for i, outcome in outcomes.items():
        if isinstance(outcome, BaseException):
            kind = type(outcome).__name__
            run.errors[kind] = run.errors.get(kind, 0) + 1
            if isinstance(outcome, MemoryError):  # OutOfDeviceMemory is one
                run.oom_failed += 1
            else:
                run.other_failed += 1
        else:
            run.finished += 1
            run.wrong += outcome[0] != i
    runs = collections.Counter(log.read_text().split()) if log.exists() else {}
    run.recomputed = sum(n - 1 for n in runs.values() if n > 1)


def _outcomes(futures: list[Future]) -> dict[int, Any]:
    """Each task's result or exception, once none is pending or lost.

    distributed marks a future ``lost`` when the worker holding its result left, then
    computes it again if it can: a lost future still lost after 60 s counts as failed.
    """
    wait_futures(futures)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and any(f.status in ("lost", "pending") for f in futures):
        with contextlib.suppress(TimeoutError):
            wait_futures([f for f in futures if f.status in ("lost", "pending")], timeout=1)
    out: dict[int, Any] = {}
    for i, f in enumerate(futures):
        if f.status == "finished":
            out[i] = f.result()
        elif f.status == "error":
            out[i] = f.exception()
        else:
            out[i] = RuntimeError(f"future {f.status}")
    return out


def _windowed(client: Client, setup: Setup, run: PolicyRun, log: Path, window: int) -> list:
    """Keep ``window`` tasks in flight: a new one each time one ends (a client-side stream)."""
    kwargs = _task_kwargs(setup, log)
    futures: list[Future] = []

    def submit(i: int) -> Future:
        with dask.annotate(resources={"GPU": 1}):
            f = client.submit(gpu_task, i, pure=False, **kwargs)
        futures.append(f)
        return f

    stream = as_completed([submit(i) for i in range(min(window, run.tasks))])
    for i in range(min(window, run.tasks), run.tasks):
        next(stream)
        stream.add(submit(i))
    return futures


def _batch(
    client: Client, setup: Setup, run: PolicyRun, log: Path, window: int | None = None
) -> None:
    """Submit every task at once, as a pipeline would (or ``window`` at a time), and wait."""
    since = time.time()
    start = time.monotonic()
    if window is None:
        with dask.annotate(resources={"GPU": 1}):
            futures = client.map(gpu_task, range(run.tasks), pure=False, **_task_kwargs(setup, log))
    else:
        futures = _windowed(client, setup, run, log, window)
    outcomes = _outcomes(futures)
    run.wall_s = time.monotonic() - start
    run.restarts = len(events(client, "add-worker", since, topic="all"))
    _classify(run, outcomes, log)


def _measured(run: PolicyRun, sampler: MemorySampler, body: Any) -> PolicyRun:
    with sampler as trace:
        body()
    run.peak_bytes = [trace.peak(d) for d in sorted(trace.used)]
    # a process that left a device: the one count every policy shares (the scheduler's
    # event log is capped and drops old events on a busy cluster)
    run.restarts = max(run.restarts, sum(len(t) for t in trace.ended.values()))
    run.trace = trace.as_dict()
    return run


def no_guard(setup: Setup, log: Path, window: int | None = None) -> PolicyRun:
    """(a) plain distributed, workers declaring ``GPU=1``."""
    run = PolicyRun("none", setup.tasks, window)
    with gpu_cluster(resources=True) as cluster, Client(cluster) as client:
        client.wait_for_workers(2)
        return _measured(run, MemorySampler(), lambda: _batch(client, setup, run, log, window))


def lifetime(setup: Setup, log: Path, seconds: float, window: int | None = None) -> PolicyRun:
    """(c) every worker restarted by its nanny every ``seconds`` ± 20%."""
    run = PolicyRun(f"lifetime {seconds:g} s", setup.tasks, window)
    options: dict[str, Any] = {
        "lifetime": f"{seconds}s",
        "lifetime_stagger": f"{seconds * 0.2}s",
        "lifetime_restart": True,
    }
    with gpu_cluster(resources=True, **options) as cluster, Client(cluster) as client:
        client.wait_for_workers(2)
        return _measured(run, MemorySampler(), lambda: _batch(client, setup, run, log, window))


def guarded(setup: Setup, log: Path, window: int | None = None) -> PolicyRun:
    """(d) accelsched with a 100 ms check, the setup's threshold and 2 confirmations.

    ``max_restarts`` is raised from its default (3 per worker per hour): the benchmark
    compresses hours of leaks into seconds.
    """
    run = PolicyRun("accelsched", setup.tasks, window)
    with gpu_cluster() as cluster, Client(cluster) as client:
        accelsched.register(
            client,
            check_interval="100ms",
            leak_threshold=setup.threshold,
            leak_confirmations=2,
            max_restarts=10_000,
        )
        wait(lambda: gpus_ready(client, 2), 60, "verified GPUs")
        since = time.time()
        _measured(run, MemorySampler(), lambda: _batch(client, setup, run, log, window))
        settled(client, 2)  # after the measurement: the last leak's restart, if any, done
        # a restart the run's leaks asked for counts, one ending after its last task too
        # (confirmed checks after its leak: a short run may end first)
        run.restarts = max(run.restarts, len(events(client, "add-worker", since, topic="all")))
        return run


async def _restart_one(dask_scheduler: Any, name: str) -> str:
    """Restart one worker through its nanny without waiting for the others to be up.

    ``client.restart_workers`` waits until as many workers are up as before: with two
    workers each restarting after every task, one is nearly always down, and it waits
    for ever. Returns the old address.
    """
    addr = next(a for a, ws in dask_scheduler.workers.items() if ws.name == name)
    await dask_scheduler.restart_workers(
        [addr], wait_for_workers=False, stimulus_id=f"benchmark-per-task-{time.time()}"
    )
    return addr


def _named(dask_scheduler: Any, name: str) -> str | None:
    return next((w.address for w in dask_scheduler.running if w.name == name), None)


def _restart(client: Client, name: str) -> None:
    """Restart worker ``name``; return once its new process runs (a new address)."""
    old = client.run_on_scheduler(_restart_one, name=name)

    def back() -> bool:
        addr = client.run_on_scheduler(_named, name=name)
        return addr is not None and addr != old

    wait(back, 60, f"worker {name} back")


def per_task(setup: Setup, log: Path) -> PolicyRun:
    """(b) a fresh process after every task: one driver thread per worker."""
    run = PolicyRun("per-task", setup.per_task_tasks, 2)
    with gpu_cluster(resources=True) as cluster, Client(cluster) as client:
        client.wait_for_workers(2)
        todo = iter(range(run.tasks))
        lock = threading.Lock()
        outcomes: dict[int, Any] = {}

        failures: list[BaseException] = []

        def drive(name: str) -> None:
            try:
                _drive(name)
            except BaseException as exc:  # re-raised in the benchmark's thread
                failures.append(exc)

        def _drive(name: str) -> None:
            while True:
                with lock:
                    i = next(todo, None)
                if i is None:
                    return
                addr = client.run_on_scheduler(_named, name=name)
                with dask.annotate(resources={"GPU": 1}):
                    f = client.submit(
                        gpu_task, i, workers=[addr], pure=False, **_task_kwargs(setup, log)
                    )
                wait_futures([f])
                outcomes[i] = f.result() if f.status == "finished" else f.exception()
                del f  # the result is on the client: the restart loses nothing
                _restart(client, name)
                with lock:
                    run.restarts += 1

        def body() -> None:
            start = time.monotonic()
            drivers = [threading.Thread(target=drive, args=(n,)) for n in ("gpu-0", "gpu-1")]
            for t in drivers:
                t.start()
            for t in drivers:
                t.join()
            if failures:
                raise failures[0]
            run.wall_s = time.monotonic() - start
            _classify(run, outcomes, log)

        return _measured(run, MemorySampler(), body)
