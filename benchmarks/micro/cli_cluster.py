"""Clusters started the way the command line starts them: ``dask scheduler`` and
``dask worker`` processes, one simulated GPU each, with their processes' CPU time.

The overhead benchmark needs the scheduler and every worker in processes of their own,
started as a user starts them, so that the CPU each spends per task can be read from
outside (``psutil``) without the benchmark's own process in the figure.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
from distributed import Client


def _bin(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


@contextlib.contextmanager
def cli_cluster(
    tmp: Path, label: str, nanny: bool = True
) -> Iterator[tuple[Client, psutil.Process]]:
    """A scheduler process and two workers (with nannies unless ``nanny`` is False), one
    fake GPU each."""
    sched_file = tmp / f"{label}.json"
    root = str(Path(__file__).resolve().parents[2])  # task functions live in this package
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "DASK_DISTRIBUTED__LOGGING__DISTRIBUTED": "error", "PYTHONPATH": path}
    procs = [
        subprocess.Popen(
            [
                _bin("dask"),
                "scheduler",
                "--no-dashboard",
                "--port",
                "0",
                "--scheduler-file",
                str(sched_file),
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    ]
    try:
        deadline = time.monotonic() + 60
        while not sched_file.exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{label}: the scheduler did not start")
            time.sleep(0.05)
        for device in ("0", "1"):
            procs.append(
                subprocess.Popen(
                    [
                        _bin("dask"),
                        "worker",
                        "--scheduler-file",
                        str(sched_file),
                        "--nthreads",
                        "1",
                        "--resources",
                        "GPU=1",
                        "--no-dashboard",
                        "--name",
                        f"{label}-{device}",
                        *([] if nanny else ["--no-nanny"]),
                    ],
                    env={**env, "CUDA_VISIBLE_DEVICES": device},
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        with Client(scheduler_file=str(sched_file), timeout="60s") as client:
            client.wait_for_workers(2, timeout=60)
            yield client, psutil.Process(procs[0].pid)
    finally:
        # the workers first, each gone before the scheduler is told: a worker closing
        # while its scheduler goes away waits out its timeouts to say goodbye
        for p in reversed(procs):
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def cpu_seconds(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def worker_processes(client: Client) -> list[psutil.Process]:
    return [psutil.Process(pid) for pid in client.run(os.getpid).values()]
