"""Verified inventory and strict placement on real clusters with fake GPUs.

Workers are real ``Nanny`` processes (each with its own ``CUDA_VISIBLE_DEVICES``) talking
to the fake ``libnvidia-ml.so.1`` through the real pynvml; the scheduler runs in this
process with validation on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import dask
import pytest
from distributed import Event, Nanny
from distributed.utils_test import gen_cluster

import accelsched
from accelsched.policy.requirements import capacity, mebibytes
from accelsched.testing import device_alloc
from tests.utils import cvd, events, gpus, until, wait_for

pytestmark = pytest.mark.usefixtures("fake_gpus_2")

GPU1 = {"resources": {"GPU": 1}}


@gen_cluster(
    client=True,
    Worker=Nanny,
    nthreads=[
        ("127.0.0.1", 1, cvd("0,1", resources={"GPU": 4})),
        ("127.0.0.1", 1, cvd("", resources={"GPU": 1})),
    ],
)
async def test_misdeclared_and_gpu_less_workers_are_corrected(c, s, a, b):
    await accelsched.register(c)
    await wait_for(lambda: len(events(s, "gpu-corrected")) == 2)
    assert gpus(s, a.worker_address) == 2
    assert gpus(s, b.worker_address) == 0
    corrected = {e["worker"]: e for e in events(s, "gpu-corrected")}
    assert corrected[a.worker_address]["declared"] == 4
    assert corrected[a.worker_address]["reason"] == "fewer-devices"
    assert corrected[b.worker_address]["reason"] == "no-devices"
    verified = events(s, "gpu-verified")
    assert [e["worker"] for e in verified] == [a.worker_address]
    assert [d["index"] for d in verified[0]["devices"]] == [0, 1]
    # the workers' own state machines agree, so they cap concurrency at 2 and 0
    totals = await c.run(lambda dask_worker: dask_worker.state.total_resources["GPU"])
    assert totals == {a.worker_address: 2, b.worker_address: 0}


@gen_cluster(client=True, Worker=Nanny, nthreads=[("127.0.0.1", 1, cvd("1"))])
async def test_undeclared_gpus_are_advertised(c, s, a):
    await accelsched.register(c)
    await wait_for(lambda: gpus(s, a.worker_address) == 1)
    (e,) = events(s, "gpu-corrected")
    assert e["reason"] == "advertised" and e["declared"] is None
    (v,) = events(s, "gpu-verified")
    assert (
        v["devices"][0]["uuid"]
        == s.plugins["accelsched-placement"].grants.of(a.worker_address).devices[0]["uuid"]
    )


@gen_cluster(client=True, Worker=Nanny, nthreads=[("127.0.0.1", 1, cvd("1"))])
async def test_advertising_can_be_switched_off(c, s, a):
    await accelsched.register(c, advertise_undeclared=False)
    await wait_for(lambda: "accelsched-guard" in s.worker_plugins)
    await c.run(lambda: None)  # the guard's setup has run once run() answers
    await wait_for(lambda: s.plugins["accelsched-placement"].grants.of(a.worker_address).reported)
    assert gpus(s, a.worker_address) == 0
    assert not events(s, "gpu-verified")


@pytest.mark.parametrize("order", ["plugins-first", "workers-first"])
def test_registration_order_gives_the_same_result(order: str, fake_gpus_2) -> None:
    from distributed import Client, LocalCluster

    def run() -> tuple:
        with (
            LocalCluster(
                n_workers=0, processes=True, dashboard_address=":0", threads_per_worker=2
            ) as cluster,
            Client(cluster) as client,
        ):
            if order == "plugins-first":
                accelsched.register(client)
            cluster.scale(1)
            client.wait_for_workers(1)
            if order == "workers-first":
                accelsched.register(client)

            def verified() -> bool:
                """a gpu-verified event"""
                return bool(events(client, "gpu-verified"))

            until(verified, timeout=15)
            with dask.annotate(resources={"GPU": 1}):
                devices = client.gather(client.map(_overlapping_device, range(2)))
            res = client.run_on_scheduler(
                lambda dask_scheduler: [w.resources for w in dask_scheduler.workers.values()]
            )
            return res, sorted(set(devices))

    # the declared-memory figure: both devices' capacity, in MiB
    memory = 2 * mebibytes(capacity(16 * 2**30))
    assert run() == ([{"GPU": 2, "GPU-memory": memory}], [0, 1])


T = TypeVar("T")


def _overlapping_device(i: int) -> int | None:
    """Tasks 0 and 1 each wait until the other runs too: they overlap on any machine."""
    return _meet(i, accelsched.current_device)


def _meet(i: int, then: Callable[[], T]) -> T:
    Event(f"running-{i}").set()
    assert Event(f"running-{1 - i}").wait(30), "the other task never ran beside this one"
    return then()


@pytest.mark.parametrize("share", [False, True])
def test_exclusive_ownership_by_uuid(share: bool, fake_gpus_2) -> None:
    """Two workers whose CUDA_VISIBLE_DEVICES name the same GPU, once by index, once by UUID."""
    from distributed import Client, LocalCluster

    uuid = fake_gpus_2.uuids[1]
    with (
        LocalCluster(n_workers=0, processes=True, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        accelsched.register(client, share_gpus=share)
        cluster.scale(0)
        first = client.sync(_start_nanny, cluster.scheduler_address, "1")
        client.wait_for_workers(1)
        _wait_events(client, "gpu-verified", 1)
        second = client.sync(_start_nanny, cluster.scheduler_address, uuid)
        client.wait_for_workers(2)
        try:
            if share:
                _wait_events(client, "gpu-verified", 2)
                assert not events(client, "gpu-rejected")
            else:
                (rejected,) = _wait_events(client, "gpu-rejected", 1)
                assert rejected["worker"] == second.worker_address
                assert rejected["owner"] == first.worker_address
                assert list(rejected["uuids"]) == [uuid]
            res = client.run_on_scheduler(
                lambda dask_scheduler: {
                    a: w.resources.get("GPU", 0) for a, w in dask_scheduler.workers.items()
                }
            )
            assert res == {first.worker_address: 1, second.worker_address: 1 if share else 0}
            # the owner leaves: the GPU is free for the next claimant
            if not share:
                client.sync(first.close)
                client.sync(second.kill)
                _wait_events(client, "gpu-verified", 2)
        finally:
            client.sync(first.close)
            client.sync(second.close)


async def _start_nanny(address: str, devices: str) -> Nanny:
    n = Nanny(address, nthreads=1, **cvd(devices))
    await n
    return n


def _wait_events(client, action: str, n: int, timeout: float = 20.0) -> list[dict]:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while len(found := events(client, action)) < n:
        assert time.monotonic() < deadline, f"expected {n} {action} events, got {found}"
        time.sleep(0.05)
    return found


@gen_cluster(
    client=True,
    Worker=Nanny,
    nthreads=[("127.0.0.1", 4, cvd("0,1", resources={"GPU": 2}))],
)
async def test_concurrency_capped_and_devices_distinct(c, s, a):
    await accelsched.register(c)
    await wait_for(lambda: gpus(s, a.worker_address) == 2)

    def step(i: int) -> tuple[int | None, float, float]:
        start = time.monotonic()
        if i < 2:
            _meet(i, lambda: None)  # two that surely overlap: both devices are used
        time.sleep(0.2)
        return accelsched.current_device(), start, time.monotonic()

    with dask.annotate(resources={"GPU": 1}):
        futs = c.map(step, range(8))
    spans = await c.gather(futs)
    assert {d for d, _, _ in spans} == {0, 1}
    # at every instant at most 2 tasks run, and tasks that overlap hold different devices
    for _, t, _ in spans:
        running = [d for d, s0, e0 in spans if s0 <= t < e0]
        assert len(running) <= 2
        assert len(set(running)) == len(running)
    # outside a GPU task there is no device
    assert await c.submit(accelsched.current_device) is None


@gen_cluster(client=True, Worker=Nanny, nthreads=[("127.0.0.1", 1, cvd(""))])
async def test_gpu_worker_joining_later_gets_waiting_tasks(c, s, a):
    await accelsched.register(c)
    with dask.annotate(resources={"GPU": 1}):
        fut = c.submit(lambda: accelsched.current_device(), key="gpu-task")
    await wait_for(
        lambda: s.tasks.get("gpu-task") is not None and s.tasks["gpu-task"].state == "no-worker"
    )
    async with Nanny(s.address, nthreads=1, env={"CUDA_VISIBLE_DEVICES": "1"}) as late:
        assert await fut == 0
        assert s.tasks["gpu-task"].who_has == {s.workers[late.worker_address]}


@gen_cluster(
    client=True,
    Worker=Nanny,
    nthreads=[("127.0.0.1", 1, cvd("0", resources={"GPU": 1})), ("127.0.0.1", 1, cvd(""))],
)
async def test_loose_restrictions_stay_hard_for_gpu(c, s, gpu, cpu):
    await accelsched.register(c)
    await wait_for(lambda: gpus(s, gpu.worker_address) == 1)
    fut = c.submit(
        accelsched.current_device,
        resources={"GPU": 1},
        workers=[cpu.worker_address],
        allow_other_workers=True,
        key="loose",
    )
    assert await fut == 0
    assert s.tasks["loose"].who_has == {s.workers[gpu.worker_address]}


@gen_cluster(client=True, Worker=Nanny, nthreads=[("127.0.0.1", 1, cvd("0"))])
async def test_unrequested_gpu_use_is_reported(c, s, a):
    await accelsched.register(c)
    await wait_for(lambda: gpus(s, a.worker_address) == 1)

    def rogue() -> int:
        buf = device_alloc(2**20, device=0)
        return buf.nbytes

    assert await c.submit(rogue, key="rogue") == 2**20
    await wait_for(lambda: events(s, "unrequested-gpu-use"))
    (e,) = events(s, "unrequested-gpu-use")
    assert e["key"] == "rogue" and e["device"] == 0 and e["context_created"] and not e["failed"]
    # a GPU task doing the same is not reported
    with dask.annotate(resources={"GPU": 1}):
        await c.submit(lambda: device_alloc(2**20).nbytes, key="polite")
    await c.submit(lambda: 1, key="cpu-only")
    assert len(events(s, "unrequested-gpu-use")) == 1


@gen_cluster(client=True, Worker=Nanny, nthreads=[("127.0.0.1", 1, cvd("0"))])
async def test_unrequested_gpu_use_can_fail_the_task(c, s, a):
    await accelsched.register(c, unrequested_gpu="fail")
    await wait_for(lambda: gpus(s, a.worker_address) == 1)
    fut = c.submit(lambda: device_alloc(2**20, device=0).nbytes, key="rogue")
    with pytest.raises(
        RuntimeError, match="did not ask for a GPU.*rogue|rogue.*did not ask for a GPU"
    ):
        await fut
    assert events(s, "unrequested-gpu-use")[0]["failed"] is True


@gen_cluster(client=True, nthreads=[("127.0.0.1", 2, GPU1)])
async def test_gate_strips_gpus_until_verified(c, s, a):
    """In-process worker, validation on: declared GPUs do not count until the guard reports."""
    await c.register_plugin(accelsched.PlacementPlugin())
    assert gpus(s, a.address) == 0
    with dask.annotate(resources={"GPU": 1}):
        fut = c.submit(accelsched.current_device, key="waits")
    await wait_for(lambda: "waits" in s.tasks and s.tasks["waits"].state == "no-worker")
    await c.register_plugin(accelsched.GuardPlugin())
    assert await fut in (0, 1)
    assert gpus(s, a.address) == 1  # declared 1 of the 2 visible: the declaration wins


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1, GPU1)])
async def test_guard_without_placement_still_corrects(c, s, a):
    with dask.config.set({"accelsched.guard.advertise-undeclared": True}):
        await c.register_plugin(accelsched.GuardPlugin())
    assert a.state.total_resources["GPU"] == 1
    assert gpus(s, a.address) == 1


@gen_cluster(client=True, nthreads=[])
async def test_register_needs_no_fusion_setting(c, s):
    """Steps marked in code survive fusion: register() asks for no setting and warns not."""
    import warnings

    with dask.config.set({"optimization.fuse.active": None}), warnings.catch_warnings():
        warnings.simplefilter("error")
        await accelsched.register(c)
