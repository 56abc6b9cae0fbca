"""Timeout-based CPU fallback on real clusters (scheduler validation on)."""

from __future__ import annotations

import logging
import time
import warnings

import dask
import dask.array as da
import numpy as np
import pytest
from distributed import Nanny
from distributed.utils_test import captured_logger, gen_cluster

import accelsched
from accelsched.testing import OutOfDeviceMemory, device_alloc
from tests.utils import events, fallback_checks, gpus, inc, past_deadline, wait_for


def where() -> str:
    return "gpu" if accelsched.current_device() is not None else "cpu"


step = accelsched.dual(lambda x: ("gpu", x), lambda x: ("cpu", x))


def _host(x):  # type: ignore[no-untyped-def]
    return ("cpu", x)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_gpu_less_cluster_falls_back_after_timeout(c, s, a):
    await accelsched.register(c, fallback_timeout="300ms")
    with dask.annotate(resources={"GPU": 1}):
        fut = c.submit(step, 1, key="x")
    t0 = time.monotonic()
    assert await fut == ("cpu", 1)
    assert time.monotonic() - t0 >= 0.3
    (e,) = events(s, "fallback")
    assert e["key"] == "x" and e["reason"] == "timeout" and e["waited"] >= 0.3
    assert s.tasks["x"].annotations["accelsched_fallback"] == "timeout"


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_strict_by_default_tasks_keep_waiting(c, s, a):
    await accelsched.register(c)
    with dask.annotate(resources={"GPU": 1}):
        fut = c.submit(step, 1, key="strict")
    await wait_for(lambda: "strict" in s.tasks and s.tasks["strict"].state == "no-worker")
    await fallback_checks(s, 3)  # several rounds of the periodic fallback check
    assert s.tasks["strict"].state == "no-worker"
    assert not events(s, "fallback")
    del fut


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_task_annotation_overrides_default_both_ways(c, s, a):
    await accelsched.register(c, fallback_timeout="200ms")
    with dask.annotate(resources={"GPU": 1}, fallback_timeout=None):
        strict = c.submit(step, 1, key="strict")
    with dask.annotate(resources={"GPU": 1}, fallback_timeout=0):
        eager = c.submit(step, 2, key="eager")
    assert await eager == ("cpu", 2)
    await past_deadline(s, "strict", 0.2)  # the default's deadline
    assert s.tasks["strict"].state == "no-worker"
    (e,) = events(s, "fallback")
    assert e["key"] == "eager" and e["reason"] == "no-gpu-capacity" and e["waited"] < 0.2
    del strict


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_plugin_strict_task_opts_in(c, s, a):
    await accelsched.register(c)  # default: never fall back
    with dask.annotate(resources={"GPU": 1}, fallback_timeout="100ms"):
        fut = c.submit(step, 3, key="opt-in")
    assert await fut == ("cpu", 3)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_invalid_annotation_errs_that_task_only(c, s, a):
    await accelsched.register(c, fallback_timeout="100ms")
    with dask.annotate(resources={"GPU": 1}, fallback_timeout="soon"):
        bad = c.submit(step, 1, key="bad")
    with dask.annotate(resources={"GPU": 1}):
        good = c.submit(step, 2, key="good")
    with pytest.raises(ValueError, match="'soon'"):
        await bad
    assert await good == ("cpu", 2)
    assert await c.submit(lambda: 42) == 42


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_a_task_released_as_its_check_errs_a_sibling_loses_no_fallback(c, s, a):
    """Two leaves with a bad annotation feed one sum, beside a task due to fall back in
    the same check: erring the first leaf errs the sum, which releases the second before
    its turn. It is left alone, and the fallback decided with them happens (before: the
    check raised on erring a released task, ``TypeError ... _transition_released_erred``,
    and the other task waited in ``no-worker`` for ever, unsaid)."""
    await accelsched.register(c)
    with dask.annotate(resources={"GPU": 1}, fallback_timeout="soon"):
        leaves = [dask.delayed(inc)(i, dask_key_name=f"leaf-{i}") for i in range(2)]
    bad = dask.delayed(sum)(leaves, dask_key_name="sum")
    with dask.annotate(resources={"GPU": 2}, fallback_timeout=0):
        ok = dask.delayed(inc)(41, dask_key_name="ok")
    with captured_logger("distributed.scheduler") as log:
        fut_bad, fut_ok = c.compute([bad, ok], optimize_graph=False)
        with pytest.raises(ValueError, match="'soon'"):
            await fut_bad
        assert await fut_ok == 42
    assert "Error transitioning" not in log.getvalue()
    assert [e["key"] for e in events(s, "fallback")] == ["ok"]


@gen_cluster(client=True, nthreads=[("127.0.0.1", 2)])
async def test_chain_falls_back_together(c, s, a):
    await accelsched.register(c, fallback_timeout="1s")
    with dask.annotate(resources={"GPU": 1}):
        fut = c.submit(inc, 0, key="chain-0")
        for i in range(1, 6):
            fut = c.submit(inc, fut, key=f"chain-{i}")
    assert await fut == 6
    fell = events(s, "fallback")
    # only the head waits its timeout; each successor falls back as soon as it is
    # unrunnable, so the chain takes one timeout plus the work, not six
    assert [e["reason"] for e in fell] == ["timeout"] + ["chain"] * 5
    assert fell[0]["waited"] >= 1.0
    assert all(e["waited"] < 1.0 for e in fell[1:])


@pytest.mark.usefixtures("fake_gpus_2")
@gen_cluster(client=True, nthreads=[], Worker=Nanny)
async def test_gpu_worker_joining_before_timeout_wins(c, s):
    await accelsched.register(c, fallback_timeout="20s")
    with dask.annotate(resources={"GPU": 1}):
        fut = c.submit(step, 1, key="late")
    await wait_for(lambda: "late" in s.tasks and s.tasks["late"].state == "no-worker")
    async with Nanny(s.address, nthreads=1, env={"CUDA_VISIBLE_DEVICES": "0"}):
        assert await fut == ("gpu", 1)
    assert not events(s, "fallback")


@pytest.mark.usefixtures("fake_gpus_2")
@gen_cluster(
    client=True,
    Worker=Nanny,
    nthreads=[("127.0.0.1", 1, {"env": {"CUDA_VISIBLE_DEVICES": ""}})],
)
async def test_gpu_worker_killed_mid_run_falls_back(c, s, cpu):
    await accelsched.register(c, fallback_timeout="500ms")
    gpu_worker = await Nanny(s.address, nthreads=1, env={"CUDA_VISIBLE_DEVICES": "0"})
    await wait_for(
        lambda: gpu_worker.worker_address in s.workers and gpus(s, gpu_worker.worker_address) == 1
    )

    def slow(x: int) -> str:
        time.sleep(0.5)
        return where()

    with dask.annotate(resources={"GPU": 1}):
        futs = c.map(slow, range(4), key=[f"slow-{i}" for i in range(4)])
    await wait_for(lambda: any(ts.state == "processing" for ts in s.tasks.values()))
    await gpu_worker.kill()
    await gpu_worker.close()
    results = await c.gather(futs)
    assert "cpu" in results
    fell = events(s, "fallback")
    assert fell and all(e["reason"] in ("timeout", "chain") for e in fell)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_no_workers_timeout_shorter_than_fallback_warns(c, s, a):
    """Said once, as one line of the scheduler's log (not also a Python warning, which a
    scheduler process would print as a second copy)."""
    with (
        dask.config.set({"distributed.scheduler.no-workers-timeout": "1s"}),
        captured_logger("accelsched.scheduler.fallback", level=logging.WARNING) as log,
        warnings.catch_warnings(record=True) as caught,
    ):
        warnings.simplefilter("always")
        await c.register_plugin(accelsched.PlacementPlugin(fallback_timeout="5s"))
    (line,) = log.getvalue().splitlines()
    assert "no-workers-timeout" in line
    assert not [w for w in caught if "no-workers-timeout" in str(w.message)]


@pytest.mark.usefixtures("fake_gpus_2")
@gen_cluster(
    client=True, Worker=Nanny, nthreads=[("127.0.0.1", 1, {"env": {"CUDA_VISIBLE_DEVICES": "0"}})]
)
async def test_oom_in_gpu_form_retries_cpu_form(c, s, a):
    await accelsched.register(
        c, oom_exceptions=["cupy.cuda.memory.OutOfMemoryError", "MemoryError"]
    )
    await wait_for(lambda: gpus(s, a.worker_address) == 1)

    def gpu_form(n: int) -> str:
        device_alloc(n)  # more than the device has
        return "gpu"

    oom = accelsched.dual(gpu_form, lambda n: "cpu")
    with dask.annotate(resources={"GPU": 1}):
        assert await c.submit(oom, 64 * 2**30, key="big") == "cpu"
        assert await c.submit(oom, 2**20, key="small") == "gpu"
    await wait_for(lambda: events(s, "fallback"))
    (e,) = events(s, "fallback")
    assert e["key"] == "big" and e["reason"] == "oom" and "OutOfDeviceMemory" in e["error"]

    def other_error(n: int) -> str:
        raise ValueError("not an OOM")

    with dask.annotate(resources={"GPU": 1}), pytest.raises(ValueError, match="not an OOM"):
        await c.submit(accelsched.dual(other_error, lambda n: "cpu"), 1, key="plain-error")

    def host_oom(n: int) -> str:
        raise MemoryError("named by its bare name")  # builtins.MemoryError: it matches

    with dask.annotate(resources={"GPU": 1}):
        assert await c.submit(accelsched.dual(host_oom, lambda n: "cpu"), 1, key="bare") == "cpu"

    def cpu_error(n: int) -> str:
        raise ValueError("the CPU form failed too")

    # the CPU form's error says why it ran
    with dask.annotate(resources={"GPU": 1}), pytest.raises(ValueError) as failed:
        await c.submit(accelsched.dual(host_oom, cpu_error), 1, key="both")
    assert str(failed.value) == "the CPU form failed too"
    assert str(failed.value.__cause__) == (
        "host_oom: the GPU form ran out of device memory (MemoryError: named by its bare "
        "name); the CPU form ran instead"
    )

    def cpu_error_with_a_cause(n: int) -> str:
        try:
            return {}["missing"]
        except KeyError as exc:
            raise ValueError("the CPU form's own cause") from exc

    # one that has a cause of its own keeps it
    with dask.annotate(resources={"GPU": 1}), pytest.raises(ValueError) as own:
        await c.submit(accelsched.dual(host_oom, cpu_error_with_a_cause), 1, key="own")
    assert isinstance(own.value.__cause__, KeyError), repr(own.value.__cause__)


def test_oom_exception_is_the_simulated_one() -> None:
    assert issubclass(OutOfDeviceMemory, MemoryError)


def normalise(block: np.ndarray) -> np.ndarray:
    xp = accelsched.array_module()
    b = xp.asarray(block)
    return (b - b.mean()) / (b.std() + 1)


def pipeline() -> da.Array:
    x = da.arange(4000, chunks=500, dtype="f8").reshape(40, 100).rechunk((10, 100))
    with dask.annotate(resources={"GPU": 1}):
        y = x.map_blocks(normalise, dtype="f8")
    return (y**2).sum(axis=1)


@pytest.mark.usefixtures("fake_gpus_2")
@gen_cluster(
    client=True,
    Worker=Nanny,
    nthreads=[("127.0.0.1", 2, {"env": {"CUDA_VISIBLE_DEVICES": "0,1"}})],
)
async def test_array_pipeline_same_numbers_on_gpu_and_fallback(c, s, a):
    await accelsched.register(c, fallback_timeout="200ms")
    await wait_for(lambda: gpus(s, a.worker_address) == 2)
    on_gpu = await c.compute(pipeline(), optimize_graph=False)
    assert not events(s, "fallback")
    # the GPU worker leaves; a CPU-only one takes over and everything falls back
    async with Nanny(s.address, nthreads=2, env={"CUDA_VISIBLE_DEVICES": ""}) as cpu:
        await c.retire_workers([a.worker_address])
        await wait_for(lambda: list(s.workers) == [cpu.worker_address])
        on_cpu = await c.compute(pipeline(), optimize_graph=False)
    assert events(s, "fallback")
    np.testing.assert_allclose(on_gpu, on_cpu)
    expected = pipeline().compute(scheduler="sync")
    np.testing.assert_allclose(on_gpu, expected)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_fallbacks_reach_prometheus_metrics(c, s, a):
    prometheus_client = pytest.importorskip("prometheus_client")
    registry = prometheus_client.REGISTRY

    def count() -> float:
        value = registry.get_sample_value("accelsched_events_total", {"action": "fallback"})
        return value or 0.0

    before = count()
    await accelsched.register(c, fallback_timeout=0)
    with dask.annotate(resources={"GPU": 1}):
        await c.gather(c.map(step, range(3), key=[f"m-{i}" for i in range(3)]))
    assert count() == before + 3
    waits = registry.get_sample_value(
        "accelsched_fallback_wait_seconds_count", {"reason": "no-gpu-capacity"}
    )
    assert waits is not None and waits >= 3


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_a_burst_of_fallbacks_is_one_event(c, s, a):
    await accelsched.register(c, fallback_timeout=0)
    futs = c.map(step, range(40), resources={"GPU": 1}, key=[f"b-{i}" for i in range(40)])
    assert await c.gather(futs) == [("cpu", i) for i in range(40)]
    fell = events(s, "fallback")
    assert sum(e["count"] for e in fell) == 40
    assert any(e["count"] > 10 and "key" not in e for e in fell)  # not 40 events
    assert len(fell) < 40


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_no_timeout_means_nothing_is_timed(c, s, a):
    """A plain function annotated with a GPU: no timeout anywhere (a dual step would
    bring its CPU form's default)."""
    await accelsched.register(c)
    futs = c.map(_host, range(20), resources={"GPU": 1}, key=[f"s-{i}" for i in range(20)])
    await wait_for(
        lambda: all(f.key in s.tasks and s.tasks[f.key].state == "no-worker" for f in futs)
    )
    plugin = s.plugins["accelsched-placement"]
    # strict tasks never enter the heap
    assert plugin.fallback.deadlines.next_deadline() is None
    assert not plugin.fallback.deadlines._heap
