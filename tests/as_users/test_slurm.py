"""Elastic GPU pools on a real single-node Slurm through dask-jobqueue.

The session starts Debian's munge and Slurm (tests/slurm.py); dask-jobqueue's
``SLURMCluster`` (a ``SpecCluster``) runs the scheduler here, with accelsched's
PlacementPlugin, and each pool worker is a Slurm job running ``dask worker``: GPU
workers see a simulated GPU (the job's script carries ``fake_gpus``' environment and
the one device the job may use), CPU workers none. Skipped only where Slurm's binaries
or root are absent; a Slurm that is there but does not start fails the test.
"""

from __future__ import annotations

import asyncio
import os
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dask
import pytest
from dask_jobqueue import SLURMCluster
from dask_jobqueue.config import reconfigure
from dask_jobqueue.slurm import SLURMJob
from distributed import Client

import accelsched
from accelsched import internals
from accelsched.testing import FakeGPUs
from tests.processes import PATHS
from tests.slurm import Slurm, missing, slurm
from tests.utils import cli, events, gpu_nap, until

pytestmark = pytest.mark.skipif(bool(missing()), reason=f"no Slurm here: {missing()}")


class PoolJob(SLURMJob):
    """A Slurm job for pool worker ``<pool>-<n>``, named as its worker (``squeue``
    shows which is which)."""

    def __init__(self, *args: Any, name: str, **kwargs: Any) -> None:
        kwargs["job_name"] = name
        super().__init__(*args, name=name, **kwargs)


class GpuPoolJob(PoolJob):
    """A GPU pool worker's job: it sees simulated GPU ``n`` only, as each job of a real
    GPU partition sees the device Slurm gave it."""

    def __init__(self, *args: Any, name: str, **kwargs: Any) -> None:
        device = str(name).rsplit("-", 1)[1]
        prologue = [*kwargs.get("job_script_prologue", []), f"export CUDA_VISIBLE_DEVICES={device}"]
        super().__init__(*args, name=name, **{**kwargs, "job_script_prologue": prologue})


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Slurm]:
    """One single-node Slurm for the session; Slurm's commands reach it (``SLURM_CONF``)."""
    with slurm(tmp_path_factory.mktemp("slurm")) as running:
        saved = os.environ.get("SLURM_CONF")
        os.environ.update(running.env)
        try:
            yield running
        finally:
            if saved is None:
                os.environ.pop("SLURM_CONF", None)
            else:
                os.environ["SLURM_CONF"] = saved


def exports(env: dict[str, str]) -> list[str]:
    return [f"export {k}={shlex.quote(v)}" for k, v in sorted(env.items())]


def pools_for(cluster: SLURMCluster, gpus: FakeGPUs) -> dict[str, Any]:
    """The two pools: the cluster's own job options (``new_spec``), each pool's job class,
    the GPU workers' ``--resources GPU=1`` and the environment each job's script sets."""
    base = cluster.new_spec["options"]
    prologue = [
        *base.get("job_script_prologue", []),
        *exports({"PYTHONPATH": os.pathsep.join(PATHS + [os.environ.get("PYTHONPATH", "")])}),
    ]
    # the CPU jobs see no GPU: without fake_gpus' variables (its library's folder taken
    # off the library path it put in front)
    hidden = " ".join(sorted(gpus.env))
    before = gpus.env.get("LD_LIBRARY_PATH", "").split(os.pathsep, 1)[1:]
    restored = exports({"LD_LIBRARY_PATH": before[0]}) if before else []
    return {
        "gpu": {
            "spec": {
                "cls": GpuPoolJob,
                "options": {
                    **base,
                    "worker_extra_args": ["--resources", "GPU=1"],
                    "job_script_prologue": prologue + exports(gpus.env),
                },
            },
            "maximum": 2,
            "devices": {"count": 1, "memory": "16GiB"},
        },
        "cpu": {
            "spec": {
                "cls": PoolJob,
                "options": {
                    **base,
                    "job_script_prologue": [
                        *prologue,
                        f"unset {hidden}",
                        *restored,
                        "export CUDA_VISIBLE_DEVICES=",
                    ],
                },
            },
            "maximum": 2,
        },
    }


def job_logs(path: Path) -> str:
    return "\n".join(f"--- {p.name}:\n{p.read_text()[-1500:]}" for p in sorted(path.glob("*")))


@pytest.mark.timeout(300)
def test_slurm_jobs_are_the_pools_workers(
    slurm_cluster: Slurm, fake_gpus_2: FakeGPUs, tmp_path: Path
) -> None:
    """12 GPU tasks on an empty SLURMCluster: a GPU pool worker starts as a Slurm job,
    is verified, and runs them all on GPUs (no fallback); a CPU task gets a CPU pool
    job; idle, the GPU pool shrinks to zero and its jobs leave ``squeue``."""
    # dask-jobqueue adds its config defaults as it is imported; a test before this one
    # in the process may have put back a config from before that import
    reconfigure()
    with (
        SLURMCluster(
            cores=1,
            memory="2GiB",
            processes=1,
            queue=slurm_cluster.partition,
            walltime="00:10:00",
            log_directory=str(tmp_path),
            scheduler_options={"host": "127.0.0.1", "dashboard_address": ":0"},
        ) as cluster,
        Client(cluster) as client,
    ):
        accelsched.register(client)
        pools = accelsched.adapt(cluster, pools=pools_for(cluster, fake_gpus_2), idle_after="2s")
        try:
            with dask.annotate(resources={"GPU": 1}, fallback_timeout="90s"):
                futures = client.map(gpu_nap, range(12), seconds=0.5, pure=False)
            cpu = client.submit(sum, [1, 2], pure=False)
            try:
                until(lambda: events(client, "gpu-verified"), timeout=90)
                # while the GPU tasks run (once idle, the pool's workers may go at once)
                gpu_jobs = [j for j in slurm_cluster.jobs() if j.startswith("gpu-")]
                ran_on = {str(w["name"]) for w in internals.workers_listed(client).values()}
                # ``accelsched status`` shows each job's worker in its pool
                code, out, err = asyncio.run(cli("status", cluster.scheduler_address))
                results = client.gather(futures)
                assert cpu.result(timeout=90) == 3
            except Exception as exc:
                raise AssertionError(
                    f"{exc!r}\nsqueue: {slurm_cluster.jobs()}\n{job_logs(tmp_path)}"
                ) from exc
            assert all(r is not None for r in results), results  # each ran on a GPU
            assert not events(client, "fallback")
            ups = events(client, "scale-up")
            assert {(e["pool"], e["reason"]) for e in ups} == {
                ("gpu", "gpu-demand"),
                ("cpu", "cpu-demand"),
            }, ups
            assert any(n.startswith("gpu-") for n in ran_on), ran_on
            assert gpu_jobs
            assert code == 0, err
            header, *rows = out.splitlines()[2:]
            assert header.split()[:2] == ["WORKER", "POOL"], out
            assert any(r.startswith("gpu-") for r in rows), out
            assert all(r.split()[1] == r.split("-")[0] for r in rows), out
            del futures, cpu  # nothing held: no worker keeps data only it has
            try:
                until(lambda: not [j for j in slurm_cluster.jobs() if j.startswith("gpu-")], 90)
            except AssertionError as exc:
                raise AssertionError(
                    f"{exc}\nsqueue: {slurm_cluster.run('squeue')}\nmembers {pools.members('gpu')}"
                    f"\nplan {pools.last_plan}\ndowns {events(client, 'scale-down')}\n"
                    f"{client.scheduler_info(n_workers=-1)['workers']}\n{job_logs(tmp_path)}"
                ) from exc
            assert not pools.members("gpu")
            downs = events(client, "scale-down")
            assert "gpu" in {e["pool"] for e in downs}
        finally:
            pools.stop()
    until(lambda: not slurm_cluster.jobs(), 60)  # the cluster's close cancels the rest
