"""GPUs that come back, with every party a process of its own.

``dask scheduler --preload accelsched`` and ``dask worker`` processes (with their
nannies), GPU workers each on one simulated GPU (``accelsched simulate --gpus 1``): a
fault is injected through the simulated GPUs' state folder, which every process of that
worker (its nanny's restarted ones too) reads at each NVML call. distributed's own GPU
diagnostics are left at their default (on).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import dask
import pytest
from distributed import Client, Event

from accelsched import internals
from accelsched.testing import state
from tests import processes
from tests.processes import running
from tests.utils import (
    ACCELSCHED,
    SIMULATE,
    events,
    hold,
    inc,
    leaky,
    left_out,
    ran_on_gpu,
    until,
)


def fake_dir() -> str:
    return os.environ[state.ENV_DIR]


def set_fault(folder: Path, on: bool) -> None:
    """Make the simulated GPU 0 fail every NVML query (or answer again), everywhere."""
    flags = state.read_flags(folder)
    state.write_flags(folder, replace(flags, faults=frozenset({(0, "all")} if on else ())))


def executing(dask_worker: Any) -> int:
    """Tasks running in this worker's threads. For ``Client.run``."""
    return len(dask_worker.state.executing)


def gpus_of(client: Client, name: str) -> tuple[str | None, float]:
    """(address, GPU count placement uses) of the worker called ``name``."""
    for addr, w in internals.workers_listed(client).items():
        if w["name"] == name:
            return addr, w["resources"].get("GPU", 0)
    return None, 0


#: A 512 MiB leak (``leaky``) is declared within a few checks.
LEAK_OPTIONS = ("--leak-threshold=256MiB", "--leak-confirmations=2")


@pytest.fixture
def cluster(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[tuple[Client, Path]]:
    sched = processes.scheduler(
        tmp_path, "--preload", "accelsched", "--check-interval=100ms", *LEAK_OPTIONS
    )
    with running(sched):
        address = processes.scheduler_address(tmp_path / "scheduler.json", sched)
        gpu = processes.worker(tmp_path, "gpu", address, before=SIMULATE)
        cpu = processes.worker(tmp_path, "cpu", address, env={"CUDA_VISIBLE_DEVICES": ""})
        with running(gpu, cpu), Client(address, timeout=30) as client:
            yield client, tmp_path
            processes.print_logs_if_failed(request, sched, gpu, cpu)


def test_a_gpu_failing_during_a_leak_restart_comes_back_across_processes(
    cluster: tuple[Client, Path],
) -> None:
    client, tmp = cluster
    until(lambda: gpus_of(client, "gpu")[1] == 1, timeout=60)
    first, _ = gpus_of(client, "gpu")
    assert first is not None
    folder = Path(client.run(fake_dir, workers=[first])[first])
    kept = client.scatter({"kept": 42}, workers=[first])

    with dask.annotate(resources={"GPU": 1}):
        leak = client.submit(leaky, 1, key="leaky-1")
    until(lambda: events(client, "restart"), timeout=60)
    set_fault(folder, True)  # while it restarts: the new process starts during the fault
    (restart,) = events(client, "restart")
    assert restart["worker"] == first and restart["reason"] == "leak"
    path = str(tmp / "runs")
    with dask.annotate(resources={"GPU": 1}):  # strict: no GPU anywhere until it is back
        futures = client.map(ran_on_gpu, [path] * 6, range(6), key=[f"g-{i}" for i in range(6)])
    until(lambda: gpus_of(client, "gpu")[0] not in (None, first), timeout=60)
    new, count = gpus_of(client, "gpu")
    assert new is not None and count == 0

    def new_process_left_it_out() -> bool:
        return bool(client.run(left_out, workers=[new])[new] == [0])

    until(new_process_left_it_out)  # its inventory was taken while the fault lasted
    assert all(f.status == "pending" for f in futures)

    set_fault(folder, False)
    until(lambda: gpus_of(client, "gpu") == (new, 1), timeout=60)
    until(lambda: events(client, "gpu-recovered"))
    (recovered,) = events(client, "gpu-recovered")
    assert recovered["worker"] == new and recovered["device"] == 0
    assert client.gather(futures) == [0] * 6
    with open(path) as f:
        assert sorted(int(line) for line in f) == list(range(6))  # each ran once
    assert kept["kept"].result() == 42
    assert leak.result() == 1
    assert len(events(client, "restart")) == 1  # the fault restarted nothing


def test_a_transient_fault_costs_no_worker_on_a_command_line_cluster(tmp_path: Path) -> None:
    """As users run it: ``dask scheduler --preload accelsched`` and two ``dask worker
    --nworkers 1`` (nannies) under ``accelsched simulate``, one GPU each. GPU 0 fails
    NVML for 3 s right after verification: within a minute both workers and both GPUs
    are in place (``accelsched status --json``), with no restart, and GPU tasks run on
    both."""
    sched = processes.scheduler(tmp_path, "--preload", "accelsched", "--check-interval=100ms")
    with running(sched):
        address = processes.scheduler_address(tmp_path / "scheduler.json", sched)
        workers = [
            processes.worker(tmp_path, name, address, "--nworkers", "1", before=SIMULATE)
            for name in ("gpu0", "gpu1")
        ]
        with running(*workers), Client(address, timeout=30) as client:

            def status() -> dict[str, int]:
                done = subprocess.run(
                    [ACCELSCHED, "status", address, "--json"],
                    capture_output=True,
                    text=True,
                    timeout=60,
                )
                assert done.returncode == 0, done.stderr
                snap = json.loads(done.stdout)
                return {w["name"]: len(w["devices"]) for w in snap["workers"]}

            try:
                until(lambda: status() == {"gpu0": 1, "gpu1": 1}, timeout=60)
                first, _ = gpus_of(client, "gpu0")
                assert first is not None
                pids = client.run(os.getpid)
                folder = Path(client.run(fake_dir, workers=[first])[first])
                set_fault(folder, True)
                until(lambda: events(client, "gpu-unhealthy"))
                until(lambda: gpus_of(client, "gpu0") == (first, 0))
                assert client.submit(inc, 1, workers=[first]).result() == 2
                time.sleep(3)
                set_fault(folder, False)
                until(lambda: status() == {"gpu0": 1, "gpu1": 1}, timeout=60)
                until(lambda: gpus_of(client, "gpu0") == (first, 1), timeout=60)
                assert client.run(os.getpid) == pids  # the same worker processes
                assert not events(client, "restart")
                with dask.annotate(resources={"GPU": 1}):  # one a GPU at a time: one each
                    held = client.map(hold, ["go", "go"], key=["h-0", "h-1"])
                until(lambda: sorted(client.run(executing).values()) == [1, 1], timeout=30)
                Event("go", client=client).set()
                assert client.gather(held) == [0, 0]
                placed = {a for addrs in client.who_has(held).values() for a in addrs}
                assert placed == set(pids)
            except BaseException:
                for p in (sched, *workers):
                    print(f"--- {p.log.name}\n{p.output()[-3000:]}")
                raise
