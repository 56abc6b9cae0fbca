"""Shared helpers for the cluster tests."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from typing import Any

from distributed import Scheduler


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
