"""Shared helpers for the cluster tests."""

from __future__ import annotations

import asyncio
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

from distributed import Client, Scheduler


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


def events(s: Scheduler, action: str | None = None) -> list[dict[str, Any]]:
    """accelsched events on the scheduler, optionally of one action."""
    out = [msg for _, msg in s.get_events("accelsched")]
    return [m for m in out if action is None or m["action"] == action]


def gpus(s: Scheduler, addr: str) -> float:
    """The GPU count the scheduler places against for ``addr``."""
    return s.workers[addr].resources.get("GPU", 0)


async def cli_process(*args: str) -> asyncio.subprocess.Process:
    """Start ``python -m accelsched.cli ARGS`` with its output piped (``--watch`` runs)."""
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "accelsched.cli",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
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
