"""Elastic GPU pools (``accelsched.adapt``) on a process cluster that starts empty.

The cluster is a ``LocalCluster`` with no worker (a ``SpecCluster``, as dask-jobqueue's
and the cloud providers' are); pools start nanny processes inside ``fake_gpus``, so each
GPU worker sees a simulated device through the real pynvml and its guard verifies it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dask
import pytest
from distributed import Client, LocalCluster, Nanny, Scheduler, Worker
from distributed.utils_test import captured_logger

import accelsched
from accelsched import internals
from accelsched.protocol import PLACEMENT_PLUGIN
from tests.utils import ROOT, cli, events, gpu_nap, inc, named_nap, until


class PoolNanny(Nanny):
    """A nanny for pool worker ``<pool>-<n>`` that sees simulated GPU ``n`` (of two) only,
    as each host of a real GPU pool sees its own devices."""

    def __init__(self, *args: Any, name: str, **kwargs: Any) -> None:
        device = str(int(str(name).rsplit("-", 1)[1]) % 2)
        kwargs["env"] = {**kwargs.get("env", {}), "CUDA_VISIBLE_DEVICES": device}
        super().__init__(*args, name=name, **kwargs)


GPU_SPEC = {"cls": PoolNanny, "options": {"nthreads": 2, "resources": {"GPU": 1}}}
CPU_SPEC = {"cls": Nanny, "options": {"nthreads": 2, "env": {"CUDA_VISIBLE_DEVICES": ""}}}


@contextlib.contextmanager
def adapted(pools: dict[str, Any], **options: Any) -> Iterator[tuple[Client, Any, Any]]:
    """A process cluster with no worker, its client with the plugins registered, and
    elastic ``pools`` sizing it: (client, the pools, adapt's warnings as logged)."""
    with (
        LocalCluster(n_workers=0, processes=True, dashboard_address=":0") as cluster,
        Client(cluster) as client,
        captured_logger("accelsched.deploy.adapt", level=logging.WARNING) as log,
    ):
        accelsched.register(client)
        elastic = accelsched.adapt(cluster, pools=pools, **options)
        try:
            yield client, elastic, log
        finally:
            elastic.stop()


def pool_workers(client: Client, pool: str) -> list[str]:
    names = [str(w["name"]) for w in internals.workers_listed(client).values()]
    return sorted(n for n in names if n.startswith(pool + "-"))


@contextlib.contextmanager
def two_pools_on_an_empty_cluster() -> Iterator[tuple[Client, Any]]:
    """A process cluster with no worker, accelsched registered, a GPU and a CPU pool of
    at most two workers each, idle workers retired after 2 s."""
    with (
        LocalCluster(n_workers=0, processes=True, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        accelsched.register(client)
        yield client, accelsched.adapt(cluster, pools=TWO_POOLS, idle_after="2s")


TWO_POOLS = {"gpu": {"spec": GPU_SPEC, "maximum": 2}, "cpu": {"spec": CPU_SPEC, "maximum": 2}}


@pytest.mark.usefixtures("fake_gpus_2")
def test_gpu_tasks_get_a_gpu_pool_worker_and_the_idle_pool_shrinks() -> None:
    """12 GPU tasks (60 s fallback timeout) on an empty cluster: a verified GPU worker
    within 20 s, all 12 on GPUs, no fallback; then the idle GPU pool shrinks to zero
    within 90 s, and the CPU pool, with no CPU work, never started."""
    with two_pools_on_an_empty_cluster() as (client, pools):
        start = time.monotonic()
        with dask.annotate(resources={"GPU": 1}, fallback_timeout="60s"):
            futures = client.map(gpu_nap, range(12), seconds=0.5, pure=False)
        until(lambda: events(client, "gpu-verified"), timeout=20)
        verified = time.monotonic() - start
        assert verified < 20
        results = client.gather(futures)
        assert all(r is not None for r in results), results  # each ran on a GPU
        assert not events(client, "fallback")
        # ``accelsched status``, as an operator runs it, shows each worker's pool
        code, out, err = asyncio.run(cli("status", client.scheduler.address, "--timeout", "20s"))
        assert code == 0, err
        header, *rows = out.splitlines()[2:]
        assert header.split()[:2] == ["WORKER", "POOL"], out
        assert rows and all(r.split()[0].startswith("gpu-") for r in rows), out
        assert all(r.split()[1] == "gpu" for r in rows), out
        (first, *_) = ups = events(client, "scale-up")
        assert first["pool"] == "gpu" and first["reason"] == "gpu-demand"
        assert list(first["classes"]) == ["1x any"]
        assert {e["pool"] for e in ups} == {"gpu"}  # no CPU work: no CPU worker
        del futures
        idle = time.monotonic()
        # none listed and none asked for: of the two asked for, one may arrive only
        # after the other did all the work and was retired, and is retired in its turn
        until(lambda: not pools.members("gpu") and not pool_workers(client, "gpu"), timeout=90)
        assert time.monotonic() - idle < 90
        downs = events(client, "scale-down")
        assert downs and {e["pool"] for e in downs} == {"gpu"}
        assert all(e["reason"] == "idle" for e in downs)


#: Set to let ``gpu-0`` of :class:`SlowNanny` start.
ARRIVE = threading.Event()


class SlowNanny(PoolNanny):
    """Pool worker ``gpu-0`` comes up only once :data:`ARRIVE` is set, as a cloud VM or a
    loaded host does long after it was asked for."""

    async def start_unsafe(self) -> Any:
        while self.name == "gpu-0" and not ARRIVE.is_set():
            await asyncio.sleep(0.1)
        return await super().start_unsafe()


#: Set once a :class:`FailingNanny` failed to start.
FAILED = threading.Event()


class FailingNanny(PoolNanny):
    """The first pool worker to start fails to (a host that does not come up)."""

    async def start_unsafe(self) -> Any:
        if not FAILED.is_set():
            FAILED.set()
            raise RuntimeError(f"{self.name}: this host does not come up")
        return await super().start_unsafe()


@pytest.mark.usefixtures("fake_gpus_2")
def test_a_worker_slow_to_start_holds_no_look_back() -> None:
    """Two GPU workers asked for, one still starting: the other does the work, and is
    retired and closed once idle while the first has still not arrived, and the looks go
    on (before: the look closing it waited, and every later look with it, for the cluster
    to start the slow one, which the cluster's own close of the idle one waits for too).
    A worker asked for meanwhile takes a name the cluster is not closing."""
    ARRIVE.clear()
    spec = {**GPU_SPEC, "cls": SlowNanny}
    with (
        LocalCluster(n_workers=0, processes=True, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        accelsched.register(client)
        pools = accelsched.adapt(
            cluster,
            pools={"gpu": {"spec": spec, "maximum": 2}},
            idle_after="1s",
            target_duration="1s",
        )
        try:
            with dask.annotate(resources={"GPU": 1}, fallback_timeout="60s"):
                futures = client.map(gpu_nap, range(4), seconds=0.5, pure=False)
            assert client.gather(futures) == [0] * 4  # each on a GPU: gpu-1's one device
            (up,) = events(client, "scale-up")
            assert up["workers"] == ("gpu-0", "gpu-1")
            del futures
            until(lambda: not pool_workers(client, "gpu"), timeout=30)
            assert events(client, "scale-down")[0]["workers"] == ("gpu-1",)
            assert pools.members("gpu") == ["gpu-0"]  # still starting
            plan = pools.last_plan  # and the looks go on meanwhile
            until(lambda: pools.last_plan is not plan, timeout=10)
            # more work: a second worker is asked for, under a name the cluster is not
            # still closing (it would start none under it: counted as starting for good)
            with dask.annotate(resources={"GPU": 1}, fallback_timeout="60s"):
                futures = client.map(gpu_nap, range(4, 8), seconds=0.5, pure=False)
            until(lambda: len(events(client, "scale-up")) == 2, timeout=10)
            assert events(client, "scale-up")[1]["workers"] == ("gpu-2",)
            ARRIVE.set()  # the slow one arrives
            assert None not in client.gather(futures)  # each on a GPU
            del futures  # idle: both retired in turn
            until(lambda: not pools.members("gpu") and not pool_workers(client, "gpu"), 60)
        finally:
            ARRIVE.set()
            pools.stop()


@pytest.mark.usefixtures("fake_gpus_2")
def test_a_worker_that_fails_to_start_is_replaced() -> None:
    """A GPU pool worker whose start fails is replaced, saying so once: the GPU task runs
    on the next one, not its CPU form (before: the failed one counted as starting for
    good, no other was asked for, and the task fell back after its timeout)."""
    FAILED.clear()
    failing = {**GPU_SPEC, "cls": FailingNanny}
    with adapted({"gpu": {"spec": failing, "maximum": 1}}) as (client, pools, log):
        with dask.annotate(resources={"GPU": 1}, fallback_timeout="60s"):
            future = client.submit(gpu_nap, 0, seconds=0.0, pure=False)
        assert future.result(timeout=45) == 0  # on a GPU
        assert FAILED.is_set()
        assert not events(client, "fallback")
        # asked for again under the name the failed one's spec no longer holds
        assert [e["workers"] for e in events(client, "scale-up")] == [("gpu-0",)] * 2
        assert pools.members("gpu") == ["gpu-0"]
        (line,) = log.getvalue().splitlines()
        assert "pool 'gpu': gpu-0 failed to start or closed; asked for again in 1s" in line


@pytest.mark.usefixtures("fake_gpus_2")
def test_a_pool_whose_class_raises_as_it_is_built_holds_up_no_other() -> None:
    """A CPU pool whose worker class raises as it is built (a bad option, as
    ``memory_limit="lots"``): the GPU pool's worker starts and runs the GPU task; the CPU
    pool's is said to have failed, naming the error, and is asked for again (before:
    distributed built every new worker in one loop, so no worker of any pool started, the
    failed one counted as starting for ever, and nothing was said but a traceback)."""
    bad = {"cls": Nanny, "options": {**CPU_SPEC["options"], "memory_limit": "lots"}}
    pools = {"gpu": {"spec": GPU_SPEC, "maximum": 1}, "cpu": {"spec": bad, "maximum": 1}}
    with adapted(pools, interval="200ms") as (client, elastic, log):
        on_cpu = client.submit(inc, 1, pure=False)  # CPU work too: the CPU pool is asked
        until(lambda: "cpu-0 (ValueError: Could not interpret 'lots'" in log.getvalue(), 30)
        with dask.annotate(resources={"GPU": 1}):  # strict
            assert client.submit(gpu_nap, 0, seconds=0.0, pure=False).result(timeout=45) == 0
        assert elastic.members("gpu") == ["gpu-0"]
        assert "failed to start or closed; asked for again in" in log.getvalue()
        assert on_cpu.result(timeout=30) == 2  # (the GPU worker runs CPU tasks too)


@pytest.mark.usefixtures("fake_gpus_2")
def test_a_gpu_pool_worker_without_a_verified_gpu_is_said_once() -> None:
    """A GPU pool's worker that sees no GPU (its ``CUDA_VISIBLE_DEVICES`` empty) counts as
    the pool's worker once ``start_timeout`` passed, and serves no GPU task: said once,
    naming it (before: nothing was said, and GPU tasks waited for the pool unexplained)."""
    blind = {"cls": Nanny, "options": {**GPU_SPEC["options"], "env": {"CUDA_VISIBLE_DEVICES": ""}}}
    pools = {"gpu": {"spec": blind, "maximum": 1}}
    with adapted(pools, interval="200ms", start_timeout="1s") as (client, _, log):
        with dask.annotate(resources={"GPU": 1}, fallback_timeout="60s"):
            future = client.submit(gpu_nap, 0, seconds=0.0, pure=False)
        said = "pool 'gpu': gpu-0 has no verified GPU"
        until(lambda: said in log.getvalue(), 60)
        time.sleep(1)  # more looks: said once
        assert log.getvalue().count(said) == 1, log.getvalue()
        assert future.status == "pending"


@pytest.mark.usefixtures("fake_gpus_2")
def test_a_gpu_worker_running_only_cpu_tasks_retires_and_finishes_them(tmp_path: Path) -> None:
    """Distributed puts CPU tasks on GPU workers too: with a CPU pool there, a GPU pool
    worker that runs only a CPU task counts as idle and is retired while it runs it (no
    new task reaches it). It is closed once the task ends, its result moved to a peer
    first: nobody fetched it before the worker closed, and it is neither lost nor computed
    again (before: closed with it, run twice). A controller started after the first
    stopped (to change an option, say) knows the retired worker from the scheduler: no
    member of its pool (before: counted as a GPU worker starting, for up to
    ``start_timeout``), and closed the same way."""
    runs = tmp_path / "runs"
    with two_pools_on_an_empty_cluster() as (client, pools):
        with dask.annotate(resources={"GPU": 1}, fallback_timeout="60s"):
            assert client.submit(gpu_nap, 0, seconds=0.0, pure=False).result(timeout=60) == 0
        assert pool_workers(client, "gpu") == ["gpu-0"] and not pool_workers(client, "cpu")
        cpu = client.submit(named_nap, str(runs), 15.0, pure=False)  # only gpu-0 to run it
        until(lambda: any("gpu-0" in e["workers"] for e in events(client, "scale-down")), 14)
        assert not cpu.done()  # retired while it runs its CPU task
        pools.stop()
        again = accelsched.adapt(pools.cluster, pools=TWO_POOLS, idle_after="2s")
        try:
            until(lambda: again.last_plan is not None, timeout=10)
            assert again.members("gpu") == [], again.last_plan
            until(lambda: "gpu-0" not in pool_workers(client, "gpu"), timeout=40)
            assert cpu.status == "finished", cpu.status  # moved before gpu-0 closed
            assert cpu.result(timeout=10) == "gpu-0"
            assert runs.read_text().split() == ["gpu-0"]  # ran once: not again elsewhere
            until(lambda: not pool_workers(client, "gpu"), timeout=30)
            assert not again.members("gpu")
        finally:
            again.stop()


@pytest.mark.usefixtures("fake_gpus_2")
def test_a_requirement_no_pool_meets_falls_back_and_a_cpu_worker_runs_it() -> None:
    """The GPU pool says nothing of its devices, so it serves no memory requirement: no
    GPU worker starts for the task, it falls back after its timeout (not held by any
    starting worker), and the CPU pool starts a worker for its CPU form."""
    with two_pools_on_an_empty_cluster() as (client, pools):
        start = time.monotonic()
        with dask.annotate(resources={"GPU": 1}, gpu={"memory": "60GiB"}, fallback_timeout="1s"):
            future = client.submit(gpu_nap, 0, seconds=0.0, pure=False)
        assert future.result(timeout=60) is None  # its CPU form: no device
        (fell,) = events(client, "fallback")
        assert fell["reason"] == "timeout" and fell["waited"] < 5
        assert time.monotonic() - start < 60
        ups = events(client, "scale-up")
        assert [(e["pool"], e["reason"]) for e in ups] == [("cpu", "cpu-demand")]
        assert not pool_workers(client, "gpu")


def test_pools_are_checked_when_given() -> None:
    """Every bad pool or option is refused at construction, naming the value."""
    with LocalCluster(n_workers=0, processes=False, dashboard_address=":0") as cluster:
        bad: list[tuple[Any, dict[str, Any], type[Exception], str]] = [
            ({}, {}, TypeError, "non-empty mapping"),
            ({"gpu-1": {"spec": GPU_SPEC}}, {}, ValueError, "'gpu-1'"),
            (
                {"gpu": {"spec": GPU_SPEC, "minimum": 3, "maximum": 2}},
                {},
                ValueError,
                "minimum=3 > maximum=2",
            ),
            ({"gpu": {"spec": GPU_SPEC, "maximum": -1}}, {}, ValueError, "maximum=-1"),
            ({"gpu": {"spec": GPU_SPEC, "maximum": 2**64}}, {}, ValueError, f"maximum={2**64}"),
            ({"gpu": {"spec": GPU_SPEC, "size": 2}}, {}, ValueError, "unknown key(s) 'size'"),
            ({"gpu": {"spec": {"options": {}}}}, {}, ValueError, "invalid spec"),
            (
                {"gpu": {"spec": GPU_SPEC, "devices": {"count": 2}}},
                {},
                ValueError,
                "devices count=2 but its workers declare",
            ),
            (
                {"gpu": {"spec": GPU_SPEC, "devices": {"memory": "lots"}}},
                {},
                ValueError,
                "invalid devices",
            ),
            (  # no number: dask would read one GiB
                {"gpu": {"spec": GPU_SPEC, "devices": {"memory": "GiB"}}},
                {},
                ValueError,
                "invalid devices: invalid GPU requirement memory='GiB'",
            ),
            (
                {"gpu": {"spec": GPU_SPEC, "devices": {"colour": "red"}}},
                {},
                ValueError,
                "unknown devices key(s) 'colour'",
            ),
            ({"cpu": {"spec": CPU_SPEC}}, {"wait_count": 0}, ValueError, "wait_count=0"),
            ({"cpu": {"spec": CPU_SPEC}}, {"interval": "soon"}, ValueError, "interval='soon'"),
            ({"cpu": {"spec": CPU_SPEC}}, {"idle": "1s"}, TypeError, "'idle'"),
            ({"cpu": {"spec": {"cls": "nosuch.Worker"}}}, {}, ValueError, "'nosuch.Worker'"),
            ({"cpu": {"spec": {"cls": "distributed.Nany"}}}, {}, ValueError, "'distributed.Nany'"),
            ({"cpu": {"spec": {"cls": 42, "options": {}}}}, {}, TypeError, "invalid spec cls"),
            ({"cpu": {"spec": {"cls": int}}}, {}, TypeError, "expected a worker class"),
            # a server, but no worker (before: taken)
            ({"cpu": {"spec": {"cls": Scheduler}}}, {}, TypeError, "expected a worker class"),
            # a name and a newline after it (before: taken, "$" matching before it)
            ({"cpu\n": {"spec": CPU_SPEC}}, {}, ValueError, "invalid pool name 'cpu\\n'"),
            (
                {"cpu": {"spec": {"cls": "collections.OrderedDict"}}},
                {},
                TypeError,
                "'collections.OrderedDict': expected a worker class",
            ),
            (
                {"gpu": {"spec": {"cls": Nanny, "options": {"resources": "GPU=1"}}}},
                {},
                TypeError,
                "pool 'gpu': invalid spec options resources='GPU=1'",
            ),
            (  # a string, not a list: read as characters, it was a CPU pool
                {
                    "gpu": {
                        "spec": {
                            "cls": Nanny,
                            "options": {"worker_extra_args": "--resources GPU=1"},
                        }
                    }
                },
                {},
                TypeError,
                "invalid spec options worker_extra_args='--resources GPU=1'",
            ),
            ({"cpu": {"spec": {"cls": Nanny, "options": {"cores": 0}}}}, {}, ValueError, "cores=0"),
            ({"cpu": {"spec": CPU_SPEC}}, {"idle_after": None}, TypeError, "idle_after=None"),
            ({"cpu": {"spec": CPU_SPEC}}, {"start_timeout": "-1s"}, ValueError, "a duration >= 0"),
        ]
        for pools, options, exc, text in bad:
            with pytest.raises(exc) as info:
                accelsched.adapt(cluster, pools=pools, **options)
            assert text in str(info.value), (pools, options, str(info.value))
        # 0, as documented: retire at once, hold no fallback back (was refused)
        zero = accelsched.adapt(cluster, pools={"cpu": {"spec": CPU_SPEC}}, idle_after=0)
        zero.stop()
        assert (zero.options["idle_after"], zero.options["start_timeout"]) == (0.0, 60.0)
        with dask.config.set({"accelsched.adapt.start-timeout": "0s"}):
            zero = accelsched.adapt(cluster, pools={"cpu": {"spec": CPU_SPEC}})
        zero.stop()
        assert zero.options["start_timeout"] == 0.0


def test_a_jobqueue_jobs_options_say_its_gpus_and_threads() -> None:
    """dask-jobqueue's job options (its cluster's ``new_spec``) carry no ``resources`` nor
    ``nthreads``: a pool reads the GPUs its job's ``dask worker`` declares
    (``worker_extra_args``) and its ``cores``; a job of several workers, or a bad
    ``--resources``, is refused naming the pool."""
    from accelsched.deploy.adapt import parse_pools

    def job(**options: Any) -> dict[str, Any]:
        return {"spec": {"cls": Nanny, "options": {"cores": 4, "processes": 1, **options}}}

    gpu = job(worker_extra_args=["--lifetime", "1h", "--resources", "GPU=2 fast=1"])
    parsed = parse_pools({"gpu": gpu, "cpu": job(cores=3)})
    assert (parsed["gpu"].pool.gpus, parsed["gpu"].pool.threads) == (2, 4)
    # one argument, as click takes it too (before: read as no GPU, a CPU pool)
    for one in (["--resources=GPU=2"], ["--lifetime=1h", "--resources=fast=1,GPU=2"]):
        assert parse_pools({"gpu": job(worker_extra_args=one)})["gpu"].pool.gpus == 2, one
    assert (parsed["cpu"].pool.gpus, parsed["cpu"].pool.threads) == (0, 3)
    with pytest.raises(ValueError, match="devices count=1 but its workers declare"):
        parse_pools({"gpu": {**gpu, "devices": {"count": 1}}})
    with pytest.raises(ValueError, match=r"'gpu': invalid --resources 'GPU=two'"):
        parse_pools({"gpu": job(worker_extra_args=["--resources", "GPU=two"])})
    with pytest.raises(ValueError, match=r"'gpu': invalid spec options processes=2"):
        parse_pools({"gpu": job(processes=2)})
    # a real job class not told its processes would split 8 cores into 4 workers named
    # '<pool>-<n>-<i>', never seen as the pool's (before: counted as starting for ever)
    from dask_jobqueue.slurm import SLURMJob

    slurm = {"spec": {"cls": SLURMJob, "options": {"cores": 8, "memory": "1GB"}}}
    (parsed_job,) = parse_pools({"cpu": slurm}).values()
    assert parsed_job.spec["options"]["processes"] == 1 and parsed_job.pool.threads == 8
    assert "processes" not in slurm["spec"]["options"]  # the caller's own spec untouched
    # a Nanny or Worker given no nthreads (or 0) runs a thread per core, as distributed
    # counts this host's (before: read as 1)
    from dask.system import CPU_COUNT

    for options in ({}, {"nthreads": None}, {"nthreads": 0}):
        (spec,) = parse_pools({"cpu": {"spec": {"cls": Nanny, "options": options}}}).values()
        assert spec.pool.threads == CPU_COUNT, options


@pytest.mark.usefixtures("fake_gpus_2")
def test_an_idle_worker_whose_data_no_peer_can_take_is_not_retired() -> None:
    """The only worker holds a result the client still wants: idle or not, it stays (no
    peer could take the data) and the result is intact; released, the pool shrinks."""
    with (
        LocalCluster(n_workers=0, processes=True, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        accelsched.register(client)
        pools = accelsched.adapt(
            cluster, pools={"gpu": {"spec": GPU_SPEC, "maximum": 1}}, idle_after="0.5s"
        )
        try:
            with dask.annotate(resources={"GPU": 1}, fallback_timeout="60s"):
                future = client.submit(gpu_nap, 0, seconds=0.0, pure=False)
            assert future.result(timeout=60) == 0
            with (
                captured_logger("distributed.scheduler") as scheduler_log,
                captured_logger("distributed.active_memory_manager") as amm_log,
            ):
                time.sleep(6)  # idle well past idle_after, wait_count looks
            # not proposed for retiring at all, so never refused (before: two warnings
            # each wait_count looks, for as long as it held the result)
            said = scheduler_log.getvalue() + amm_log.getvalue()
            assert "retir" not in said.lower(), said
            assert pool_workers(client, "gpu") == ["gpu-0"]
            assert not events(client, "scale-down")
            assert future.result(timeout=10) == 0  # still there, not recomputed elsewhere
            del future
            until(lambda: not pool_workers(client, "gpu"), timeout=60)
            (down,) = events(client, "scale-down")
            assert list(down["workers"]) == ["gpu-0"]
        finally:
            pools.stop()


def test_every_adapt_option_is_configured_and_documented() -> None:
    from accelsched.config import ADAPT_OPTIONS, config_value

    page = (ROOT / "docs" / "configuration.md").read_text()
    for o in ADAPT_OPTIONS:
        assert config_value(o.key, builtin=True) is not None, o.key
        assert f"`{o.key}`" in page and f"### `{o.name}`" in page, o.name


def test_without_the_placement_plugin_the_pools_wait_and_say_why_once() -> None:
    from distributed.utils_test import captured_logger

    with (
        captured_logger("accelsched.deploy.adapt") as log,
        captured_logger("distributed.core") as scheduler_log,
        LocalCluster(n_workers=0, processes=False, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        # (an in-process worker: this cluster's scheduler listens in process only)
        spec = {"cls": Worker, "options": {"nthreads": 1}}
        pools = accelsched.adapt(cluster, pools={"cpu": {"spec": spec}}, interval="100ms")
        try:
            future = client.submit(sum, [1, 2])
            until(lambda: "PlacementPlugin" in log.getvalue(), timeout=10)
            time.sleep(0.5)  # more looks: said once
            assert log.getvalue().count("PlacementPlugin") == 1
            assert not pools.members("cpu") and not events(client, "scale-up")
            # the scheduler logs each request to a handler it lacks with a traceback:
            # each look asks its metadata instead (before: the demand itself, asked
            # after a wait that doubled; earlier still, every look flooded its log)
            assert "No handler" not in scheduler_log.getvalue(), scheduler_log.getvalue()
            # registered later, it is seen at the next look: the task gets its worker
            accelsched.register(client)
            assert future.result(timeout=30) == 3 and pools.members("cpu")
            # unregistered: the next look asks the metadata again, not the demand (before:
            # once answered, it asked the demand, left there with a traceback). Looks by
            # hand from here, so that none is under way as it is unregistered
            pools.stop()
            client.unregister_scheduler_plugin(PLACEMENT_PLUGIN)
            cluster.sync(pools.adapt)
            assert log.getvalue().count("PlacementPlugin") == 2  # said again
            assert "No handler" not in scheduler_log.getvalue(), scheduler_log.getvalue()
        finally:
            pools.stop()


def test_one_controller_sizes_a_cluster() -> None:
    """As ``cluster.adapt`` does: ``accelsched.adapt`` stops the controller before it,
    saying so, and a later ``cluster.adapt()`` or the cluster's close stops it; two
    controllers would fight over the cluster's workers."""
    from distributed.utils_test import captured_logger

    with (
        captured_logger("accelsched.deploy.adapt") as log,
        LocalCluster(n_workers=0, processes=False, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        accelsched.register(client)
        plain = cluster.adapt(minimum=0, maximum=1)
        pools = accelsched.adapt(cluster, pools={"cpu": {"spec": CPU_SPEC}})
        assert plain.state == "stopped" and pools.state in ("starting", "running")
        assert "stopped the cluster's earlier adaptive controller (Adaptive)" in log.getvalue()
        again = accelsched.adapt(cluster, pools={"cpu": {"spec": CPU_SPEC}})
        assert pools.state == "stopped"
        assert "(ElasticPools)" in log.getvalue()
        cluster.adapt(minimum=0, maximum=1).stop()
        assert again.state == "stopped"
        # a refused call leaves the running controller alone
        last = accelsched.adapt(cluster, pools={"cpu": {"spec": CPU_SPEC}})
        with pytest.raises(ValueError, match="minimum=2 > maximum=1"):
            accelsched.adapt(cluster, pools={"cpu": {"spec": CPU_SPEC, "minimum": 2}})
        assert last.state in ("starting", "running")
    assert last.state == "stopped"  # the cluster's close stopped it


def test_a_look_neither_retires_a_drained_worker_nor_reuses_a_lingering_name() -> None:
    """One look's reading of what the scheduler said (its workers as its reply lists
    them; no worker started): a pool worker accelsched drains to restart it (closing
    gracefully, not said retiring, not running) is not idle, so the pools never retire it
    in its restart's gap; and a new worker never takes the name of one the scheduler
    still lists (a closed worker's may linger: the new one would be taken for it, and
    refused)."""
    from accelsched.policy.scaling import Plan

    def worker(name: str, *, running: bool) -> dict[str, Any]:
        return {
            "name": name,
            "address": f"tcp://{name}",
            "busy": False,
            "gpu_busy": False,
            "gpus": 1,
            "retiring": False,
            "running": running,
            "holds": False,
        }

    with LocalCluster(n_workers=0, processes=False, dashboard_address=":0") as cluster:
        pools = accelsched.adapt(cluster, pools={"gpu": {"spec": GPU_SPEC, "maximum": 3}})
        pools.stop()  # looks are taken by hand here
        cluster.worker_spec.update({"gpu-0": {}, "gpu-1": {}})  # (their specs only)
        now = time.monotonic()
        pools._started.update({"gpu-0": now - 100, "gpu-1": now - 100})
        listed = {"gpu-0": worker("gpu-0", running=False), "gpu-1": worker("gpu-1", running=True)}
        (state,) = pools._states(listed, now).values()
        assert (state.running, state.starting, list(state.idle)) == (2, 0, ["gpu-1"])
        del cluster.worker_spec["gpu-0"], cluster.worker_spec["gpu-1"]
        pools._listed = {"gpu-0"}  # closed, still listed while it goes
        plan = Plan({"gpu": 1}, {"gpu": "gpu-demand"}, [], {}, {}, [])
        cluster.sync(pools._scale_up, plan, now)
        assert list(cluster.worker_spec) == ["gpu-1"]


def test_a_member_the_cluster_let_go_is_replaced() -> None:
    """Looks taken by hand, on a cluster's worker objects set by hand (its corrections
    stubbed: these objects start nothing). A member the cluster held a worker for and no
    longer holds, the scheduler not listing it (a job that ended: the cluster lets its
    object go some seconds after its worker left), or a job whose submission failed
    (still ``created``), is replaced: its spec goes at once (no correction starts it
    again), said once. Its pool asks again after a wait, which doubles only when one
    asked for since it began fails too, and ends when one of those arrives (not when an
    older member is listed, nor when only an older one fails). A member not yet held
    (starting) is kept, and a new name is none the cluster holds an object under, nor one
    the scheduler stopped listing within the cluster's lost-worker-timeout."""
    from distributed.core import Status

    from accelsched.policy.scaling import Plan

    class Job:  # a worker object as the cluster holds it (a job in a queue: "running")
        def __init__(self, status: Status = Status.running) -> None:
            self.status = status

    async def nothing(*args: Any) -> None:
        """the cluster's correction and close, stubbed"""

    def look(now: float, *listed: str) -> None:
        """the look's reading of failed members, on the cluster's loop, as a look runs"""

        async def replace() -> None:
            pools._replace_failed(dict.fromkeys(listed, {"retiring": False}), now)

        cluster.sync(replace)

    with (
        LocalCluster(n_workers=0, processes=False, dashboard_address=":0") as cluster,
        captured_logger("accelsched.deploy.adapt", level=logging.WARNING) as log,
    ):
        pools = accelsched.adapt(cluster, pools={"gpu": {"spec": GPU_SPEC, "maximum": 3}})
        pools.stop()  # looks are taken by hand here
        correct, scale_down = cluster._correct_state, cluster.scale_down
        cluster._correct_state = cluster.scale_down = nothing  # type: ignore[method-assign]
        try:
            cluster.worker_spec.update({"gpu-0": {}, "gpu-1": {}, "gpu-2": {}})
            pools._started.update({"gpu-0": 90.0, "gpu-1": 90.0, "gpu-2": 90.0})
            cluster.workers.update({"gpu-0": Job(), "gpu-2": Job()})  # gpu-1: not held yet
            look(100.0, "gpu-2")
            assert pools.members("gpu") == ["gpu-0", "gpu-1", "gpu-2"] and not log.getvalue()
            del cluster.workers["gpu-0"]  # the cluster let it go
            look(101.0, "gpu-2")
            assert pools.members("gpu") == ["gpu-1", "gpu-2"]
            assert "gpu-0" not in cluster.worker_spec  # at once
            (line,) = log.getvalue().splitlines()
            assert "pool 'gpu': gpu-0 failed to start or closed; asked for again in 1s" in line
            look(101.5, "gpu-2")  # said once; gpu-2 ends no wait
            assert len(log.getvalue().splitlines()) == 1 and "gpu" in pools._held_back
            plan = Plan({"gpu": 3}, {"gpu": "gpu-demand"}, [], {}, {}, [])
            cluster.sync(pools._scale_up, plan, 101.5)  # within its wait: none asked for
            assert sorted(cluster.worker_spec) == ["gpu-1", "gpu-2"]
            cluster.workers["gpu-0"] = Job()  # an object still held under a free name
            cluster.sync(pools._scale_up, plan, 102.5)
            assert sorted(cluster.worker_spec) == ["gpu-1", "gpu-2", "gpu-3"]
            # gpu-3, asked for since the wait began, fails too (its job was never
            # submitted): the wait doubles
            cluster.workers["gpu-3"] = Job(Status.created)
            look(103.0, "gpu-2")
            assert (
                log.getvalue()
                .splitlines()[-1]
                .endswith("gpu-3 failed to start or closed; asked for again in 2s")
            )
            cluster.sync(pools._scale_up, plan, 104.5)  # within its wait
            assert sorted(cluster.worker_spec) == ["gpu-1", "gpu-2"]
            cluster.sync(pools._scale_up, plan, 105.0)  # (gpu-3's object is still held)
            assert sorted(cluster.worker_spec) == ["gpu-1", "gpu-2", "gpu-4"]
            look(106.0, "gpu-2", "gpu-4")  # it arrives: no wait
            assert "gpu" not in pools._held_back
            # gpu-4 fails: a wait of 1 s; the one asked for then (gpu-5) fails after an
            # older member (gpu-2) did: the wait doubles, counted from its beginning
            cluster.workers["gpu-4"] = Job(Status.closed)
            look(107.0, "gpu-2")
            cluster.sync(pools._scale_up, plan, 108.0)
            assert sorted(cluster.worker_spec) == ["gpu-1", "gpu-2", "gpu-5"]
            cluster.workers["gpu-2"].status = Status.closed
            look(109.0)
            cluster.workers["gpu-5"] = Job(Status.failed)
            look(110.0)
            assert [line.rsplit(": ", 1)[1] for line in log.getvalue().splitlines()[-3:]] == [
                "gpu-4 failed to start or closed; asked for again in 1s",
                "gpu-2 failed to start or closed; asked for again in 1s",
                "gpu-5 failed to start or closed; asked for again in 2s",
            ]
            # the demand ends and the pool empties: a minute after its wait ended (the
            # longest wait), its failures are history, and a failure when it is asked
            # again waits 1 s (before: 4 s, doubled from the last wait, however long ago);
            # a look without demand sooner forgets nothing (demand that comes and goes
            # between failures would keep the wait at 1 s)
            del cluster.worker_spec["gpu-1"]
            idle = Plan({"gpu": 0}, {}, [], {}, {}, [])
            for now in (111.0, 113.0, 171.0):  # within its wait; after it, within a minute
                cluster.sync(pools._scale_up, idle, now)
                assert "gpu" in pools._held_back, now
            cluster.sync(pools._scale_up, idle, 172.0)
            assert "gpu" not in pools._held_back
            cluster.sync(pools._scale_up, Plan({"gpu": 1}, {}, [], {}, {}, []), 300.0)
            (new,) = cluster.worker_spec
            cluster.workers[new] = Job(Status.failed)
            look(301.0)
            assert (
                log.getvalue()
                .splitlines()[-1]
                .endswith(f"{new} failed to start or closed; asked for again in 1s")
            )
            # a name the scheduler stopped listing is given to no new worker until the
            # cluster's lost-worker-timeout passed: the cluster then closes whatever it
            # holds under that name (a new job not connected yet would go)
            cluster.workers.clear()
            cluster.worker_spec.clear()
            pools._held_back.clear()
            pools._see({"gpu-0": {}}, 200.0)
            pools._see({}, 201.0)
            one = Plan({"gpu": 1}, {"gpu": "gpu-demand"}, [], {}, {}, [])
            cluster.sync(pools._scale_up, one, 202.0)
            assert list(cluster.worker_spec) == ["gpu-1"]
            cluster.worker_spec.clear()
            pools._see({}, 216.0)  # 15 s: distributed's default
            cluster.sync(pools._scale_up, one, 216.0)
            assert list(cluster.worker_spec) == ["gpu-0"]
        finally:
            cluster._correct_state, cluster.scale_down = correct, scale_down  # type: ignore[method-assign]
            cluster.workers.clear()
            cluster.worker_spec.clear()


def test_new_pool_workers_on_a_jobqueue_cluster_keep_their_specs() -> None:
    """dask-jobqueue's ``scale(n)`` counts workers and divides them by its default job's
    processes: the pools start theirs through ``SpecCluster.scale`` at the cluster's own
    size, so a pool's new spec stays (before: 2 asked for on a cluster whose default job
    runs 4 workers, 1 kept). The cluster's correction is stubbed: no Slurm here."""
    from dask_jobqueue import SLURMCluster
    from dask_jobqueue.config import reconfigure

    from accelsched.policy.scaling import Plan

    async def nothing() -> None:
        """the cluster's correction, stubbed"""

    # dask-jobqueue adds its config defaults as it is imported; a test before this one in
    # the process may have put back a config from before that import
    reconfigure()
    with SLURMCluster(
        cores=8, memory="8GB", scheduler_options={"host": "127.0.0.1", "dashboard_address": ":0"}
    ) as cluster:
        assert cluster._dummy_job.worker_processes > 1  # (its default job: several)
        job = {"cls": cluster.job_cls, "options": dict(cluster.new_spec["options"])}
        pools = accelsched.adapt(cluster, pools={"gpu": {"spec": job, "maximum": 2}})
        pools.stop()  # looks are taken by hand here
        correct = cluster._correct_state
        cluster._correct_state = nothing  # type: ignore[method-assign]
        try:
            plan = Plan({"gpu": 2}, {"gpu": "gpu-demand"}, [], {}, {}, [])
            cluster.sync(pools._scale_up, plan, time.monotonic())
            assert sorted(cluster.worker_spec) == ["gpu-0", "gpu-1"]
        finally:
            cluster._correct_state = correct  # type: ignore[method-assign]
            cluster.worker_spec.clear()
