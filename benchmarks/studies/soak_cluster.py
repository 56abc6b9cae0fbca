"""The soak's cluster and its faults, as users run a cluster: separate processes.

``dask scheduler --preload accelsched`` (short check and fallback settings) and ``dask
worker`` processes, each a nanny with its worker, on simulated GPUs of different sizes
(one ``fake_gpus`` session of this process: every worker sees its own devices through
``CUDA_VISIBLE_DEVICES``, and a device can be made to fail NVML in every process at once),
and one CPU-only worker. One worker joins late.

The faults, drawn up front from a seed (:func:`benchmarks.studies.soak_plan.plan`), are
carried out at their times by :class:`Faults` in a thread of its own
while the workload goes on: a worker process SIGKILLed (its nanny starts it again), a
worker SIGTERMed and a new one started on its devices a few seconds later (leave and
join), a device failing NVML for a few seconds, ``client.restart_workers`` of one worker.
A ``dask worker`` that exits on its own is started again, as a supervisor would.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
from distributed import Client

from accelsched import internals
from accelsched.testing import FakeGPUs
from benchmarks.studies.soak_plan import WORKERS, Fault, Spec

#: The scheduler's ``--preload accelsched`` arguments: checks, fallbacks and restarts a
#: few times faster than the defaults, and a restart budget the leaks never exhaust (a
#: quarantined worker would be a decision, not a stuck task, but it would hide the rest).
SCHEDULER_OPTIONS = (
    "--check-interval", "250ms",
    "--fallback-interval", "250ms",
    "--max-restarts", "1000",
    "--restart-window", "1h",
)  # fmt: skip


def _bin(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


@dataclass
class Cluster:
    """The scheduler and worker processes, their logs in ``tmp``."""

    tmp: Path
    env: dict[str, str] = field(default_factory=dict)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    lock: threading.RLock = field(default_factory=threading.RLock)

    def __post_init__(self) -> None:
        root = str(Path(__file__).resolve().parents[2])  # the tasks live in this package
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
        self.env = {**os.environ, "PYTHONPATH": path}

    def _start(self, name: str, args: list[str], env: dict[str, str]) -> None:
        with (self.tmp / f"{name}.log").open("ab") as log:
            self.procs[name] = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    def start_scheduler(self) -> str:
        file = self.tmp / "scheduler.json"
        args = [_bin("dask"), "scheduler", "--port", "0", "--no-dashboard"]
        args += ["--scheduler-file", str(file), "--preload", "accelsched", *SCHEDULER_OPTIONS]
        self._start("scheduler", args, self.env)
        deadline = time.monotonic() + 60
        while not file.exists() or not file.read_text().strip().endswith("}"):
            if time.monotonic() > deadline or self.procs["scheduler"].poll() is not None:
                raise RuntimeError(f"the scheduler did not start: see {self.tmp}/scheduler.log")
            time.sleep(0.1)
        return str(file)

    def start_worker(self, spec: Spec) -> None:
        args = [_bin("dask"), "worker", "--scheduler-file", str(self.tmp / "scheduler.json")]
        args += ["--nthreads", str(spec.nthreads), "--name", spec.name, "--no-dashboard"]
        args += ["--local-directory", str(self.tmp / spec.name)]
        with self.lock:
            self._start(spec.name, args, {**self.env, "CUDA_VISIBLE_DEVICES": spec.devices})

    def up(self, name: str) -> bool:
        with self.lock:
            proc = self.procs.get(name)
            return proc is not None and proc.poll() is None

    def stop(self, name: str, timeout: float = 30) -> None:
        """SIGTERM (the nanny closes its worker), SIGKILL to the group past ``timeout``."""
        with self.lock:
            proc = self.procs.get(name)
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        with suppress(subprocess.TimeoutExpired):
            proc.wait(timeout)
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # whatever the nanny left
        proc.wait()

    def kill_worker_process(self, name: str, timeout: float = 15) -> bool:
        """SIGKILL the worker process under ``name``'s nanny; False if there is none
        within ``timeout`` (its nanny may be between two worker processes: a restart)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                proc = self.procs.get(name)
            if proc is None or proc.poll() is not None:
                return False
            with suppress(psutil.Error):
                for worker in _worker_processes(psutil.Process(proc.pid)):
                    worker.send_signal(signal.SIGKILL)
                    return True
            time.sleep(0.2)
        return False

    def close(self) -> None:
        """Workers first, then the scheduler: a worker outliving it waits out timeouts."""
        for name in [n for n in self.procs if n != "scheduler"] + ["scheduler"]:
            self.stop(name, timeout=15)


def _worker_processes(nanny: psutil.Process) -> list[psutil.Process]:
    """The nanny's worker process: a child it spawned, or one its fork server forked
    (accelsched's fast restarts); not the resource tracker, not the fork server."""
    found = []
    for child in nanny.children():
        command = " ".join(child.cmdline())
        if "spawn_main" in command:
            found.append(child)
        elif "forkserver" in command:
            found.extend(child.children())
    return found


class Faults(threading.Thread):
    """Carries out a plan against a cluster, from ``start`` on; ``done`` lists what was
    done (a fault whose worker is away at its time goes to the next worker that is up)."""

    def __init__(
        self, cluster: Cluster, gpus: FakeGPUs, client: Client, faults: list[Fault], start: float
    ) -> None:
        super().__init__(name="soak-faults", daemon=True)
        self.cluster, self.gpus, self.client, self.faults = cluster, gpus, client, faults
        self.start_time = start
        self.done: list[dict[str, Any]] = []
        self.stopped = threading.Event()
        self.followups: list[threading.Thread] = []
        self.gpu_lock = threading.Lock()
        self.away: set[str] = set()
        self.exits: list[dict[str, Any]] = []  # workers that exited on their own
        self.restarted: dict[str, float] = {}

    def run(self) -> None:
        for fault in self.faults:
            if self.stopped.wait(max(0.0, self.start_time + fault.at - time.time())):
                return
            try:
                target = self._apply(fault)
            except Exception as exc:  # noqa: BLE001 - a fault that could not be made is said
                target = f"failed: {type(exc).__name__}: {exc}"
            record = {"at": round(time.time() - self.start_time, 1), "kind": fault.kind}
            self.done.append({**record, "target": target, "planned": str(fault).strip()})
            print(f"  fault {record['at']:7.1f} s  {fault.kind:<15} {target}", flush=True)

    def _later(self, fn: Any, *args: Any) -> None:
        thread = threading.Thread(target=fn, args=args, daemon=True)
        thread.start()
        self.followups.append(thread)

    def _worker(self, wanted: str) -> str | None:
        """``wanted`` if it is up, else the next worker in order that is."""
        names = [s.name for s in WORKERS]
        i = names.index(wanted)
        for name in names[i:] + names[:i]:
            if name not in self.away and self.cluster.up(name):
                return name
        return None

    def _apply(self, fault: Fault) -> str:
        spec = {s.name: s for s in WORKERS}
        if fault.kind == "late-join":
            self.cluster.start_worker(spec[fault.target])
            return fault.target
        if fault.kind == "nvml":
            device = int(fault.target)
            with self.gpu_lock:
                self.gpus.fail(device, fault.calls)
            self._later(self._recover, device, fault.seconds)
            return f"device {device} ({fault.calls}, {fault.seconds:.1f} s)"
        name = self._worker(fault.target)
        if name is None:
            return "skipped: no worker up"
        if fault.kind == "kill":
            return name if self.cluster.kill_worker_process(name) else f"skipped: {name}"
        if fault.kind == "leave-join":
            self.away.add(name)
            self._later(self._leave_join, spec[name], fault.seconds)
            return f"{name} (away {fault.seconds:.1f} s)"
        address = [
            a for a, w in internals.workers_listed(self.client).items() if w.get("name") == name
        ]
        if not address:
            return f"skipped: {name} not registered"
        self._later(self.client.restart_workers, address, 60, False)
        return name

    def _recover(self, device: int, seconds: float) -> None:
        time.sleep(seconds)
        with self.gpu_lock:
            self.gpus.recover(device)

    def _leave_join(self, spec: Spec, seconds: float) -> None:
        self.cluster.stop(spec.name)
        time.sleep(seconds)
        self.cluster.start_worker(spec)
        self.away.discard(spec.name)

    def supervise(self) -> None:
        """Start again a ``dask worker`` that exited on its own, as a process supervisor
        (systemd, Kubernetes) would, at most every 2 s: distributed's nanny exits at
        start when NVML fails on its first GPU (its system monitor reads the device's
        memory). Each exit is recorded with the last line of its log."""
        now = time.time()
        for spec in WORKERS:
            proc = self.cluster.procs.get(spec.name)
            if proc is None or proc.poll() is None or spec.name in self.away:
                continue
            if now - self.restarted.get(spec.name, 0) < 2:
                continue
            lines = (self.cluster.tmp / f"{spec.name}.log").read_text(errors="replace")
            last = lines.strip().splitlines()[-1:] or [""]
            at = round(now - self.start_time, 1)
            self.exits.append({"at": at, "worker": spec.name, "code": proc.returncode})
            self.exits[-1]["last"] = last[0][-200:]
            print(
                f"  exit  {at:7.1f} s  {spec.name} ({proc.returncode}): {last[0][-120:]}",
                flush=True,
            )
            self.restarted[spec.name] = now
            self.cluster.start_worker(spec)

    def finish(self) -> Counter[str]:
        """Stop, let every follow-up end (devices recovered, workers back), start a late
        worker the plan did not reach; the faults done, by kind."""
        self.stopped.set()
        self.join()
        for thread in self.followups:
            thread.join(120)
        with self.gpu_lock:
            self.gpus.recover()
        for spec in WORKERS:
            if not self.cluster.up(spec.name) and spec.name not in self.away:
                self.cluster.start_worker(spec)
        return Counter(d["kind"] for d in self.done if "skipped" not in str(d["target"]))
