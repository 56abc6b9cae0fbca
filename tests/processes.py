"""Real ``dask scheduler`` / ``dask worker`` / ``dask cuda worker`` processes for tests.

Each runs the ``dask`` command of the interpreter running the tests, with this process's
environment (so inside ``fake_gpus`` it sees the fake devices) plus what a test adds, its
output in a log file the test can read.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import pytest

from tests.utils import ROOT

DASK = str(Path(sys.executable).with_name("dask"))
#: On the processes' path, so they unpickle the tests' functions (pytest imports a test
#: module by its file name, from its folder under tests/; the shared helpers as
#: ``tests.utils``).
PATHS = [
    str(ROOT),
    str(ROOT / "tests"),
    *sorted(str(d) for d in (ROOT / "tests").iterdir() if d.is_dir() and d.name.isidentifier()),
]


#: Each phase's report of a test ("setup", "call", "teardown"), kept by the conftest's
#: hook: a fixture's teardown asks it whether its test failed (pytest does not raise a
#: test's failure into its fixtures).
REPORTS = pytest.StashKey[dict[str, pytest.TestReport]]()


def print_logs_if_failed(request: pytest.FixtureRequest, *procs: Process) -> None:
    """In a fixture's teardown: the end of each process's log, beside its test's failure."""
    call = request.node.stash.get(REPORTS, {}).get("call")
    if call is not None and call.failed:
        for p in procs:
            print(f"--- {p.log.name}\n{p.output()[-3000:]}")


class Process:
    """One command line, its log, and how to end it."""

    def __init__(
        self,
        args: list[str],
        log: Path,
        env: dict[str, str] | None = None,
        *,
        paths: Sequence[str] = PATHS,
        cwd: Path | None = None,
    ) -> None:
        """``paths`` go first on the process's PYTHONPATH (the tests' folders by default:
        a process that must not import the tests' modules gets fewer)."""
        self.args = args
        self.log = log
        env = dict(env or {})
        extra = env.pop("PYTHONPATH", os.environ.get("PYTHONPATH"))
        path = os.pathsep.join(p for p in (*paths, extra) if p)
        full_env = {**os.environ, **env, "PYTHONPATH": path}
        with open(log, "wb") as out:
            self.popen = subprocess.Popen(
                args,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=full_env,
                cwd=cwd,
                start_new_session=True,
            )

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait(self, timeout: float) -> int:
        """The exit code; the test fails with the log if it runs longer than ``timeout``."""
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise AssertionError(
                f"{' '.join(self.args)} still ran after {timeout}s:\n{self.output()[-3000:]}"
            ) from None

    def stop(self) -> None:
        """SIGTERM (dask closes cleanly), then SIGKILL for the whole process group."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            with suppress(subprocess.TimeoutExpired):
                self.popen.wait(15)
        with suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGKILL)  # its nanny's worker processes
        self.popen.wait()


def scheduler_address(path: Path, proc: Process, timeout: float = 60) -> str:
    """The address a ``--scheduler-file`` names, once the scheduler wrote it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            try:
                return str(json.loads(path.read_text())["address"])
            except (ValueError, KeyError):
                pass  # being written
        if proc.popen.poll() is not None:
            raise AssertionError(f"the scheduler exited:\n{proc.output()[-3000:]}")
        time.sleep(0.05)
    raise AssertionError(f"no scheduler file after {timeout}s:\n{proc.output()[-3000:]}")


@contextmanager
def running(*procs: Process) -> Iterator[tuple[Process, ...]]:
    """Stop every process on the way out, workers before the scheduler."""
    try:
        yield procs
    finally:
        for proc in reversed(procs):
            proc.stop()


def scheduler(tmp: Path, *args: str, env: dict[str, str] | None = None, **process: Any) -> Process:
    """``dask scheduler`` on a free port, writing ``tmp/scheduler.json``; ``process``:
    :class:`Process`'s keywords."""
    return Process(
        [DASK, "scheduler", "--port", "0", "--no-dashboard"]
        + ["--scheduler-file", str(tmp / "scheduler.json"), *args],
        tmp / "scheduler.log",
        env,
        **process,
    )


def worker(
    tmp: Path,
    name: str,
    address: str,
    *args: str,
    env: dict[str, str] | None = None,
    before: Sequence[str] = (),
    **process: Any,
) -> Process:
    """``dask worker`` (one nanny, one thread) on ``address``, run by the command
    ``before`` when given (``accelsched simulate --gpus 1 --``)."""
    return Process(
        [*before, DASK, "worker", address, "--nthreads", "1", "--no-dashboard", "--name", name]
        + ["--local-directory", str(tmp / name), *args],
        tmp / f"{name}.log",
        env,
        **process,
    )
