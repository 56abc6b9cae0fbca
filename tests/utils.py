"""Shared helpers for the tests: one home for what more than one test module needs.

Functions that run on workers (tasks, ``Client.run`` callbacks) live here at module level
so that they pickle by reference: any worker process, forked or spawned, started by a
nanny here or by a ``dask worker`` command with the repository on its path, imports
them by name.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import dask
from distributed import Client, Event, Nanny, Scheduler

import accelsched
from accelsched import internals
from accelsched.protocol import PLACEMENT_PLUGIN
from accelsched.testing import device_alloc

MiB = 2**20
GiB = 2**30
#: The names of the two models of the ``mixed_gpus`` fixture (tests/conftest.py).
H100, A100 = "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB"
#: What a fake GPU charges a process for its CUDA context, beside what it allocates.
CTX = 64 * MiB

#: The source tree, wherever accelsched is installed.
ROOT = Path(__file__).resolve().parents[1]
#: The venv's ``accelsched`` command, as a user runs it.
ACCELSCHED = str(Path(sys.executable).with_name("accelsched"))
#: What a command is run under to be a machine with one simulated 16 GiB GPU.
SIMULATE = [ACCELSCHED, "simulate", "--gpus", "1", "--memory", "16GiB", "--"]

#: Guard options that declare a 512 MiB leak within a few tenths of a second, so a test
#: waits for a leak in checks, not in seconds. A test that needs other values says so
#: beside these: ``{**FAST, "check_interval": "50ms"}``.
FAST: dict[str, Any] = dict(check_interval="100ms", leak_threshold="256MiB", leak_confirmations=2)
#: Checks after which a leak present at the start would have been declared under
#: :data:`FAST`, and one more: a "no leak" assertion waits this many.
CONFIRMED = FAST["leak_confirmations"] + 1


def cvd(devices: str, **worker: Any) -> dict[str, Any]:
    """Keywords for a nanny worker that sees ``devices`` (its ``CUDA_VISIBLE_DEVICES``,
    ``""`` for none) and whatever else ``worker`` adds (``resources``, ...).

    What a worker may see is the one thing each cluster test sets about its hardware."""
    return {"env": {"CUDA_VISIBLE_DEVICES": devices}, **worker}


#: ``gen_cluster(nthreads=...)`` for two nanny workers, one fake GPU each.
TWO_GPU_WORKERS = [("127.0.0.1", 1, cvd("0")), ("127.0.0.1", 1, cvd("1"))]
#: ``gen_cluster(nthreads=...)`` for one in-process worker that declares one GPU.
GPU_WORKER = [("127.0.0.1", 1, {"resources": {"GPU": 1}})]


# --- tasks ------------------------------------------------------------------------------


def inc(x: int) -> int:
    return x + 1


def warm_up() -> int:
    """A first task on a device: the process gets its CUDA context, as real GPU work does."""
    device_alloc(MiB)
    return 0


@accelsched.gpu
def marked_warm_up() -> int:
    """:func:`warm_up` as a step marked in code (a GPU task without an annotation)."""
    device_alloc(MiB)
    return 0


def leaky(i: int) -> int:
    """Leaks 512 MiB of device memory (twice the :data:`FAST` threshold) for the life of
    its worker process, as an array nobody frees does."""
    device_alloc(512 * MiB, leak=True)
    return i


def device_result(i: int) -> object:
    """A result holding 64 MiB of device memory and carrying ``i``: live data its worker
    keeps, which the guard must hold, not count as a leak, and a restart must move."""
    return device_alloc(64 * MiB, value=i)


def hold(name: str, returns: Any = None) -> Any:
    """Keeps its thread busy until the distributed ``Event(name)`` is set; then returns
    ``returns``, or, when None, the device it ran on (None off a GPU).

    A task that is surely running while the test does something else, and ends when told."""
    Event(name).wait()
    return accelsched.current_device() if returns is None else returns


def ran_on_gpu(path: str, i: int) -> int | None:
    """A GPU step that notes each run, one line per execution in any process: the file
    tells whether a task ran once, not at all, or again after a restart."""
    with open(path, "a") as f:
        f.write(f"{i}\n")
    return accelsched.current_device()


def gpu_nap(i: int, seconds: float) -> int | None:
    """A GPU task that takes ``seconds``: the device it ran on (None off a GPU)."""
    time.sleep(seconds)
    return accelsched.current_device()


def named_nap(path: str, seconds: float) -> str:
    """A CPU task that takes ``seconds`` and notes each run in ``path`` (a task computed
    again after its worker closed shows twice): the name of the worker it ran on."""
    from distributed import get_worker

    with open(path, "a") as f:
        f.write(f"{get_worker().name}\n")
    time.sleep(seconds)
    return str(get_worker().name)


def left_out(dask_worker: Any) -> list[int] | None:
    """The devices this worker's guard left out of its inventory (they failed NVML when
    it was taken); None until its guard is set up. For ``Client.run``."""
    guard = dask_worker.plugins.get("accelsched-guard")
    return None if guard is None else guard.inventory.monitor.left_out


# --- what the scheduler says --------------------------------------------------------------


def events(source: Scheduler | Client, action: str | None = None) -> list[dict[str, Any]]:
    """accelsched events on the scheduler, optionally of one action.

    ``source`` is the scheduler itself or a synchronous client of it (an asynchronous
    client would return a coroutine): tests in this process and tests of ``dask``
    command processes read the same log the same way."""
    out = [msg for _, msg in source.get_events("accelsched")]
    return [m for m in out if action is None or m["action"] == action]


def gpus(s: Scheduler, addr: str) -> float:
    """The GPU count the scheduler places against for ``addr``."""
    return s.workers[addr].resources.get("GPU", 0)


def gpu_counts(client: Client, by_name: bool = False) -> dict[str, float]:
    """Worker address (or name) -> the GPU count the scheduler places against, through a
    synchronous client: what a test of ``dask`` command processes can see."""
    info = internals.workers_listed(client)
    return {w["name"] if by_name else a: w["resources"].get("GPU", 0) for a, w in info.items()}


def verified_now(s: Scheduler, *nannies: Nanny, count: float | None = None) -> bool:
    """Whether each nanny's current worker is connected and offers verified GPUs:
    ``count`` of them, or any number when None.

    A nanny's worker address changes when it restarts, so this follows the restarted
    process, not the one a test started with."""

    def offers(addr: str) -> bool:
        n = gpus(s, addr)
        return n >= 1 if count is None else n == count

    return all(n.worker_address in s.workers and offers(n.worker_address) for n in nannies)


async def verified(
    s: Scheduler, *nannies: Nanny, count: float | None = None, timeout: float = 15.0
) -> None:
    """Wait until each nanny's worker offers its verified GPUs (as
    :func:`verified_now`): before that, a GPU task waits for placement and a leak check
    has no device to check."""

    def done() -> bool:
        """each nanny's worker to offer its verified GPUs"""
        return verified_now(s, *nannies, count=count)

    await wait_for(done, timeout)


def computed_once(s: Scheduler, key: str) -> bool:
    """Whether ``key`` was processing exactly once: a result that survived a restart was
    moved, not recomputed."""
    return sum(1 for t in s.story(key) if t[2] == "processing") == 1


def status_snapshot(s: Scheduler) -> Any:
    """What ``accelsched status`` and the dashboard show, read on the scheduler."""
    return s.plugins[PLACEMENT_PLUGIN].status_history.snapshot()


async def wait_for(
    predicate: Callable[[], Any], timeout: float = 15.0, interval: float = 0.02
) -> None:
    """Poll until ``predicate()`` is truthy; fail the test with what it waited for."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(
                f"timed out after {timeout}s waiting for {predicate.__doc__ or predicate}"
            )
        await asyncio.sleep(interval)


def until(predicate: Callable[[], Any], timeout: float = 30) -> None:
    """Poll (blocking) until ``predicate()`` holds; fail naming it. :func:`wait_for` for a
    test that drives ``dask`` command processes through a synchronous client."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {predicate.__doc__ or predicate}")
        time.sleep(0.05)


def _as_from_a_terminal() -> None:
    """In the child, before it runs: Ctrl-C acts, as in a user's shell. A test process can
    hold SIGINT ignored (under pytest-xdist a worker sometimes does), and an ignored
    disposition is inherited: Python then installs no KeyboardInterrupt for it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


async def cli_process(*args: str) -> asyncio.subprocess.Process:
    """Start ``python -m accelsched.cli ARGS`` with its output piped (``--watch`` runs)."""
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "accelsched.cli",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        preexec_fn=_as_from_a_terminal,
    )


async def cli(*args: str, timeout: float = 60) -> tuple[int, str, str]:
    """Run ``python -m accelsched.cli ARGS``; (exit code, stdout, stderr)."""
    proc = await cli_process(*args)
    out, err = await asyncio.wait_for(proc.communicate(), timeout)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def _guard_checks(dask_worker: Any) -> int | None:
    """Leak checks this worker's guard completed (None until its guard is set up)."""
    guard = dask_worker.plugins.get("accelsched-guard")
    leaks = getattr(guard, "leaks", None)
    return None if leaks is None else leaks.checks


def _mark_stream(token: str, dask_worker: Any) -> None:
    dask_worker.log_event(BARRIER, token)


#: The event topic :func:`events_arrived` sends its marker under.
BARRIER = "tests-barrier"


async def events_arrived(c: Client, s: Scheduler, workers: list[str]) -> None:
    """Wait until every event ``workers`` sent so far has reached the scheduler.

    A worker's events travel on its batched stream, in order: once a marker sent after
    them arrived, so did they."""
    token = uuid.uuid4().hex
    await c.run(_mark_stream, token, workers=workers)

    def arrived() -> bool:
        """the marker events from every worker"""
        return sum(1 for _, msg in s.get_events(BARRIER) if msg == token) >= len(workers)

    await wait_for(arrived)


async def guard_checks(c: Client, s: Scheduler, workers: list[str], n: int) -> None:
    """Wait until the guard of each of ``workers`` completed ``n`` leak checks more than
    it had when called, and the events those checks sent reached the scheduler.

    What a check finds is judged at the next one (``leak_confirmations`` checks in a row
    declare a leak), so a "no leak" assertion needs at least that many checks after the
    moment it is about; waiting on the count, not on a clock, keeps it true on a loaded
    machine."""

    async def counts() -> dict[str, int | None]:
        return await c.run(_guard_checks, workers=workers)

    start: dict[str, int | None] = {}

    async def poll() -> None:
        nonlocal start
        start = await counts()
        while None in start.values():  # a guard still setting up (a restarted worker)
            await asyncio.sleep(0.02)
            start = await counts()

    await asyncio.wait_for(poll(), 15)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 15 + n
    while True:
        now = await counts()
        if all((now[w] or 0) >= (start[w] or 0) + n for w in workers):
            break
        if loop.time() > deadline:
            raise AssertionError(f"guards did not run {n} checks: {start} -> {now}")
        await asyncio.sleep(0.02)
    await events_arrived(c, s, workers)


def background(s: Scheduler) -> set[asyncio.Task]:
    """The scheduler's background work now (accelsched spawns its restarts there).

    Open connections are left out: each serves its comm there for as long as it stays
    open (a worker's pooled connection, idle between requests), and a request the test
    already has the reply to is no longer served by it."""
    return {
        t
        for t in s._ongoing_background_tasks._ongoing_tasks
        if getattr(t.get_coro(), "__qualname__", "") != "Server._handle_comm"
    }


async def settled(s: Scheduler, before: set[asyncio.Task]) -> None:
    """Wait until every background task the scheduler started since ``before`` (a
    :func:`background` snapshot) has finished: whatever a request set going is over."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 60
    while started := background(s) - before:
        if loop.time() > deadline:
            raise AssertionError(f"still running after 60s: {[t.get_coro() for t in started]}")
        await asyncio.sleep(0.02)


async def fallback_checks(s: Scheduler, n: int) -> None:
    """Wait until the PlacementPlugin completed ``n`` fallback checks more than it had."""
    fallback = s.plugins["accelsched-placement"].fallback
    target = fallback.checks + n

    def done() -> bool:
        """the fallback checks"""
        return fallback.checks >= target

    await wait_for(done)


async def past_deadline(s: Scheduler, key: str, timeout: float) -> None:
    """Wait until the unrunnable ``key`` has waited ``timeout`` and two fallback checks ran
    since: had it been given that timeout, it would have fallen back by now."""
    since = s.unrunnable[s.tasks[key]]  # monotonic, as the plugin's deadlines

    def expired() -> bool:
        """the timeout to pass"""
        return time.monotonic() > since + timeout

    await wait_for(expired)
    await fallback_checks(s, 2)


# --- a two-nanny cluster with a leak and its restart ---------------------------------------

#: The names of the nannies :func:`named_nannies` starts.
NAMES = ("alpha", "beta")


async def named_nannies(stack: AsyncExitStack, s: Scheduler) -> list[Nanny]:
    """Two nannies named ``alpha`` and ``beta``, each owning its own fake GPU: what the
    status table and the dashboard list by name."""
    return [
        await stack.enter_async_context(Nanny(s.address, name=name, nthreads=1, **cvd(str(i))))
        for i, name in enumerate(NAMES)
    ]


async def leak_and_restart(c: Client, s: Scheduler, target: Nanny) -> None:
    """Register accelsched, leak on ``target``, wait until it is restarted and both
    workers report their figures again (heartbeat metric)."""
    await accelsched.register(c, **FAST)
    await wait_for(lambda: sum(len(w["devices"]) for w in status_snapshot(s)["workers"]) == 2)
    with dask.annotate(resources={"GPU": 1}):
        await c.submit(leaky, 1, key="leaky-1", workers=[target.worker_address])
    await wait_for(lambda: events(s, "restart"), timeout=30)

    def figures_back() -> bool:
        """both workers verified again, with figures from a heartbeat"""
        snap = status_snapshot(s)
        devices = [d for w in snap["workers"] for d in w["devices"]]
        return (
            len(snap["workers"]) == 2
            and len(devices) == 2
            and all(d["leases"] is not None for d in devices)
        )

    await wait_for(figures_back, timeout=30)


# --- a fresh interpreter ----------------------------------------------------------------------


def run_python(
    code: str,
    *args: str,
    cwd: Path | str = ROOT,
    env: dict[str, str] | None = None,
    timeout: float = 60,
) -> str:
    """Run ``code`` with ``args`` in a fresh interpreter; its output, stripped, once it
    exited 0 (else the test fails with its error output).

    ``env`` is the child's whole environment (None: this process's). What a process sees
    that imported nothing first (NVML, CUDA, pickled steps) only a new one can show."""
    done = subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, f"subprocess failed ({done.returncode}):\n{done.stderr[-4000:]}"
    return done.stdout.strip()


def last_json(output: str) -> Any:
    """The JSON document a child printed last: whatever a library printed before it
    (a warning, a banner) stays out of the answer."""
    return json.loads(output.splitlines()[-1])
