"""A single-node Slurm (Debian's slurm-wlm and munge) for tests, started and stopped here.

No systemd: ``munged``, ``slurmctld`` and ``slurmd`` run as root in the foreground of
their own process groups, every file (munge key and socket, ``slurm.conf``, state and
spool, logs) under one temporary folder, this host the controller and its only node,
process tracking by ``/proc`` (``proctrack/linuxproc``, ``task/none``: no cgroups, as a
container allows). Slurm's commands find it through ``SLURM_CONF``.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

from tests.processes import Process

DAEMONS = ("munged", "slurmctld", "slurmd")
COMMANDS = ("sbatch", "squeue", "scancel", "sinfo")
#: The node's CPUs as Slurm counts them (more than the machine has: jobs share cores).
CPUS = 16


def missing() -> str | None:
    """Why this machine cannot run :func:`slurm` (None: it can)."""
    if os.geteuid() != 0:
        return "a single-node Slurm is started as root; the tests run as another user"
    absent = [
        name for name in DAEMONS + COMMANDS + ("mungekey",) if not shutil.which(name, path=_path())
    ]
    if absent:
        return f"no {', '.join(absent)} (Debian: apt-get install slurm-wlm munge)"
    return None


def _path() -> str:
    return os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Slurm:
    """A running single-node Slurm: its configuration, partition and daemons."""

    root: Path
    conf: Path
    partition: str
    node: str
    daemons: list[Process] = field(default_factory=list)

    @property
    def env(self) -> dict[str, str]:
        """What Slurm's commands need to reach it."""
        return {"SLURM_CONF": str(self.conf)}

    def run(self, *args: str) -> str:
        """A Slurm command's output; the test fails with its error and the logs."""
        done = subprocess.run(
            list(args), env={**os.environ, **self.env}, capture_output=True, text=True, timeout=30
        )
        if done.returncode:
            raise AssertionError(
                f"{' '.join(args)} exited {done.returncode}: {done.stderr}\n{self.logs()}"
            )
        return done.stdout

    def jobs(self) -> list[str]:
        """The names of the jobs Slurm has queued or running."""
        return self.run("squeue", "--noheader", "--format=%j").split()

    def logs(self) -> str:
        return "\n".join(f"--- {d.log.name}:\n{d.output()[-2000:]}" for d in self.daemons)


def _configure(root: Path, node: str, partition: str) -> Path:
    for sub in ("state", "spool", "munge"):
        (root / sub).mkdir(mode=0o700)
    conf = root / "slurm.conf"
    conf.write_text(
        "\n".join(
            [
                "ClusterName=accelsched",
                f"SlurmctldHost={node}(127.0.0.1)",
                "SlurmUser=root",
                "SlurmdUser=root",
                f"SlurmctldPort={_free_port()}",
                f"SlurmdPort={_free_port()}",
                "AuthType=auth/munge",
                "CredType=cred/munge",
                f"AuthInfo=socket={root / 'munge' / 'munge.socket'}",
                "MpiDefault=none",
                "ProctrackType=proctrack/linuxproc",
                "TaskPlugin=task/none",
                "JobAcctGatherType=jobacct_gather/none",
                "AccountingStorageType=accounting_storage/none",
                "SchedulerType=sched/backfill",
                "SelectType=select/cons_tres",
                "SelectTypeParameters=CR_CPU",
                "SlurmdParameters=config_overrides",
                "ReturnToService=2",
                "SlurmctldTimeout=30",
                "SlurmdTimeout=30",
                "MinJobAge=2",
                "KillWait=5",
                f"StateSaveLocation={root / 'state'}",
                f"SlurmdSpoolDir={root / 'spool'}",
                f"SlurmctldPidFile={root / 'slurmctld.pid'}",
                f"SlurmdPidFile={root / 'slurmd.pid'}",
                f"NodeName={node} NodeAddr=127.0.0.1 CPUs={CPUS} RealMemory=65536 State=UNKNOWN",
                f"PartitionName={partition} Nodes={node} Default=YES MaxTime=INFINITE State=UP",
                "",
            ]
        )
    )
    return conf


@contextmanager
def slurm(root: Path, timeout: float = 60) -> Iterator[Slurm]:
    """Start munge and Slurm under ``root``; wait until ``sinfo`` shows the node idle
    (an ``AssertionError`` with the daemons' logs when it does not); stop them on exit."""
    node = socket.gethostname().split(".")[0]
    cluster = Slurm(root, _configure(root, node, "debug"), "debug", node)
    munge = root / "munge"
    key = munge / "munge.key"
    subprocess.run(
        ["mungekey", "--create", f"--keyfile={key}"],
        check=True,
        env={**os.environ, "PATH": _path()},
    )
    key.chmod(0o400)
    env = {**cluster.env, "PATH": _path()}
    try:
        cluster.daemons.append(
            Process(
                [
                    "munged",
                    "--foreground",
                    "--force",
                    f"--key-file={key}",
                    f"--socket={munge / 'munge.socket'}",
                    f"--pid-file={munge / 'munged.pid'}",
                    f"--seed-file={munge / 'munge.seed'}",
                    f"--log-file={munge / 'munged.log'}",
                ],
                root / "munged.log",
                env,
            )
        )
        for daemon in ("slurmctld", "slurmd"):
            cluster.daemons.append(
                Process([daemon, "-D", "-f", str(cluster.conf)], root / f"{daemon}.log", env)
            )
            if daemon == "slurmctld":
                time.sleep(0.5)  # slurmd registers with a controller that listens
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            for d in cluster.daemons:
                if d.popen.poll() is not None:
                    raise AssertionError(f"{d.args[0]} exited:\n{cluster.logs()}")
            with suppress(subprocess.SubprocessError, AssertionError):
                state = cluster.run("sinfo", "--noheader", "--format=%t").strip()
                if state == "idle":
                    break
            time.sleep(0.5)
        else:
            raise AssertionError(
                f"Slurm's node is not idle after {timeout}s (sinfo: {state!r}):\n{cluster.logs()}"
            )
        yield cluster
    finally:
        _drain(cluster)
        for d in reversed(cluster.daemons):
            d.stop()


def _drain(cluster: Slurm, timeout: float = 20) -> None:
    """Cancel what is left and let it end while Slurm runs: a job's ``slurmstepd``
    outlives a ``slurmd`` stopped under it."""
    if any(d.popen.poll() is not None for d in cluster.daemons):
        return
    with suppress(AssertionError, subprocess.SubprocessError):
        cluster.run("scancel", f"--partition={cluster.partition}")
        deadline = time.monotonic() + timeout
        while cluster.jobs() and time.monotonic() < deadline:
            time.sleep(0.5)
