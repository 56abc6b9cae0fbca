"""NVML faults, injected through ``FakeGPUs.fail`` / ``lose`` / ``recover``: they never
reach user tasks; a failing GPU is withdrawn once, without stranding tasks, offered again
when it answers; its worker is kept (no restart into a fault a new process would meet
too), with distributed's own GPU diagnostics at their default."""

from __future__ import annotations

import asyncio
import os

import dask
import pynvml
import pytest
from distributed import Event, Nanny
from distributed.utils_test import gen_cluster

import accelsched
from accelsched.devices import NVMLMonitor
from accelsched.policy.leak import DeviceHealth
from accelsched.testing import fake_gpus, standin
from tests.utils import (
    FAST,
    TWO_GPU_WORKERS,
    cvd,
    events,
    events_arrived,
    gpus,
    guard_checks,
    hold,
    inc,
    leaky,
    left_out,
    ran_on_gpu,
    status_snapshot,
    wait_for,
)

# ---- the fault-injection API, honoured by the fake library and the stand-in --------------


@pytest.mark.parametrize(
    "calls, failing, error",
    [
        ("all", {"uuid", "memory", "processes"}, pynvml.NVMLError_Unknown),
        ("memory", {"memory"}, pynvml.NVMLError_Unknown),
        ("processes", {"processes"}, pynvml.NVMLError_Unknown),
        ("lost", {"uuid", "memory", "processes"}, pynvml.NVMLError_GpuIsLost),
    ],
)
def test_fault_kinds_in_the_library_and_the_standin(
    calls: str, failing: set[str], error: type
) -> None:
    with fake_gpus(2) as g:
        libraries = [standin] if g.standin else [pynvml, standin]
        g.fail(1, calls)
        for nvml in libraries:
            nvml.nvmlInit()
            try:
                queries = {
                    "uuid": nvml.nvmlDeviceGetUUID,
                    "memory": nvml.nvmlDeviceGetMemoryInfo,
                    "processes": nvml.nvmlDeviceGetComputeRunningProcesses,
                }
                healthy, broken = (nvml.nvmlDeviceGetHandleByIndex(i) for i in (0, 1))
                for name, query in queries.items():
                    query(healthy)
                    if name in failing:
                        with pytest.raises(error):
                            query(broken)
                    else:
                        query(broken)
                g.recover(1)
                for query in queries.values():
                    query(broken)
                g.fail(1, calls)
            finally:
                nvml.nvmlShutdown()


def test_fault_arguments_are_checked() -> None:
    with fake_gpus(2) as g:
        with pytest.raises(ValueError, match="no device 2"):
            g.fail(2)
        with pytest.raises(ValueError, match="calls must be one of"):
            g.fail(0, "power")
        with pytest.raises(TypeError, match="device must be an int"):
            g.fail("0")  # type: ignore[arg-type]


def test_a_failing_device_is_left_out_of_a_new_inventory() -> None:
    with fake_gpus(3) as g:
        g.lose(1)
        devices = NVMLMonitor(env={}).devices()
        # CUDA's numbering is kept: device 2 is still CUDA index 2
        assert [(d.index, d.uuid) for d in devices] == [(0, g.uuids[0]), (2, g.uuids[2])]


# ---- on a cluster ------------------------------------------------------------------------

#: Answers in a row a device that failed once needs before it is offered again.
STREAK = DeviceHealth().streak


def busy_device(worker) -> int:  # type: ignore[no-untyped-def]
    guard = worker.plugins["accelsched-guard"]
    (devices,) = guard.binder.leases.holders().values()
    return devices[0]


@pytest.mark.parametrize(
    "calls, recover", [("all", True), ("all", False), ("memory", True), ("processes", True)]
)
def test_failing_gpu_is_withdrawn_once_and_offered_again(calls: str, recover: bool) -> None:
    @gen_cluster(client=True, nthreads=[("127.0.0.1", 4, {"resources": {"GPU": 2}})], timeout=60)
    async def run(c, s, a):  # type: ignore[no-untyped-def]
        await accelsched.register(
            c, check_interval="50ms", unrequested_gpu="fail", recover_gpus=recover
        )
        await wait_for(lambda: gpus(s, a.address) == 2)
        with dask.annotate(resources={"GPU": 1}):
            one = c.submit(hold, "one", key="one")
        # executing as the worker's state says, and holding its device as its thread
        # took it (the thread leases after the state machine says executing)
        leases = a.plugins["accelsched-guard"].binder.leases
        await wait_for(
            lambda: (
                "one" in a.state.tasks
                and a.state.tasks["one"].state == "executing"
                and "one" in leases.holders()
            )
        )
        held = busy_device(a)
        with dask.annotate(resources={"GPU": 2}):
            two = c.submit(accelsched.current_device, key="two")  # assigned, waits for one
        await wait_for(lambda: "two" in a.state.tasks)
        g.fail(1 - held, calls)  # in-process workers see every GPU: CUDA index = NVML index

        await wait_for(lambda: gpus(s, a.address) == 1)
        # the 2-GPU task no longer fits here: back to the scheduler, not stranded
        await wait_for(lambda: s.tasks["two"].state == "no-worker")
        # NVML faults never reach user tasks (unrequested_gpu="fail" reads NVML around them)
        assert await c.gather(c.map(inc, range(20))) == list(range(1, 21))
        # the running task keeps its device; then GPU work goes on on the one that answers
        await Event("one").set()
        assert await one == held
        with dask.annotate(resources={"GPU": 1}):
            assert await c.submit(accelsched.current_device, key="more") == held
        await guard_checks(c, s, [a.address], STREAK + 2)  # the device still fails each
        (unhealthy,) = events(s, "gpu-unhealthy")
        assert unhealthy["device"] == 1 - held and "Unknown" in unhealthy["error"]
        assert gpus(s, a.address) == 1  # still one fewer, whatever the fault's kind
        # no restart into a fault it can see: the worker is kept, not quarantined
        assert not events(s, "restart-deferred") and not events(s, "restart")
        assert not events(s, "quarantine")

        g.recover()
        if recover:
            await wait_for(lambda: events(s, "gpu-recovered"))
            await wait_for(lambda: gpus(s, a.address) == 2)
        else:  # answering for longer than it takes to be offered again: kept out
            await guard_checks(c, s, [a.address], STREAK + 2)
            assert not events(s, "gpu-recovered") and gpus(s, a.address) == 1
            # it answers now: a restart would take it back; no nanny here, so deferred
            # (once), and the worker is not quarantined for it
            await wait_for(lambda: events(s, "restart-deferred"))
            await guard_checks(c, s, [a.address], STREAK + 2)
            assert [e["reason"] for e in events(s, "restart-deferred")] == ["no-nanny"]
            assert not events(s, "quarantine")
        if recover:
            assert await two in (0, 1)
        else:
            assert s.tasks["two"].state == "no-worker"
        assert len(events(s, "gpu-unhealthy")) == 1

    with fake_gpus(2) as g:
        run()


@pytest.mark.parametrize("peer", [True, False])
def test_a_lost_gpu_keeps_its_worker(peer: bool) -> None:
    """A GPU off the bus (``NVMLError_GpuIsLost``) is withdrawn and its worker kept, with
    distributed's GPU diagnostics at their default: no restart into a fault a new
    process would meet too; the worker serves CPU work, keeps its data, and GPU work
    goes to the peer's GPU."""

    @gen_cluster(
        client=True, Worker=Nanny, nthreads=TWO_GPU_WORKERS if peer else TWO_GPU_WORKERS[:1]
    )
    async def run(c, s, a, *peers):  # type: ignore[no-untyped-def]
        await accelsched.register(c, check_interval="100ms")
        A = a.worker_address
        workers = [A] + [p.worker_address for p in peers]
        await wait_for(lambda: all(gpus(s, w) == 1 for w in workers))
        pid = (await c.run(os.getpid, workers=[A]))[A]
        kept = await c.scatter({"kept": 42}, workers=[A])
        g.lose(0)
        await wait_for(lambda: events(s, "gpu-unhealthy"), timeout=30)
        (unhealthy,) = events(s, "gpu-unhealthy")
        assert unhealthy["worker"] == A and "GpuIsLost" in unhealthy["error"]
        await wait_for(lambda: gpus(s, A) == 0)
        await guard_checks(c, s, [A], 2 * STREAK + 2)  # lost all along: kept, still out
        assert not events(s, "restart") and not events(s, "restart-deferred")
        assert set(s.workers) == set(workers) and gpus(s, A) == 0
        assert (await c.run(os.getpid, workers=[A]))[A] == pid  # the same process
        assert await c.submit(inc, 1, workers=[A], key="cpu") == 2
        assert await kept["kept"] == 42
        if peer:
            with dask.annotate(resources={"GPU": 1}):
                assert await c.submit(accelsched.current_device, key="after") == 0
            assert s.tasks["after"].who_has == {s.workers[workers[1]]}

    with fake_gpus(2) as g:
        run()


def test_a_flapping_gpu_is_reported_once_and_kept_out() -> None:
    @gen_cluster(client=True, nthreads=[("127.0.0.1", 2, {"resources": {"GPU": 2}})], timeout=60)
    async def run(c, s, a):  # type: ignore[no-untyped-def]
        # checked by hand, one check a turn: a timer would put a varying number of checks
        # in each turn (more than it takes to come back, on a loaded machine)
        await accelsched.register(c, check_interval="1h")
        await wait_for(lambda: gpus(s, a.address) == 2)
        guard = a.plugins["accelsched-guard"]
        for _ in range(16):  # fails and answers by turns, faster than it may come back
            g.fail(1)
            guard.check()
            await asyncio.sleep(0)  # what the check set going (a withdrawal) runs
            g.recover(1)
            guard.check()
            await asyncio.sleep(0)
        await events_arrived(c, s, [a.address])
        assert len(events(s, "gpu-unhealthy")) == 1
        assert not events(s, "gpu-recovered")
        await wait_for(lambda: gpus(s, a.address) == 1)
        for _ in range(STREAK):  # steady: back
            guard.check()
        await wait_for(lambda: events(s, "gpu-recovered"), timeout=10)
        await wait_for(lambda: gpus(s, a.address) == 2)

    with fake_gpus(2) as g:
        run()


def test_a_gpu_failing_during_a_leak_restart_comes_back_when_it_answers(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The only GPU worker, with a peer, restarts for a leak and its GPU fails NVML while
    it does: the new process starts anyway (distributed's GPU diagnostics at their
    default) and leaves the device out; once it answers steadily it is verified and
    offered again, and the strict GPU tasks that waited meanwhile run, once each."""

    @gen_cluster(
        client=True,
        Worker=Nanny,
        nthreads=[("127.0.0.1", 1, cvd("0")), ("127.0.0.1", 1, cvd(""))],
        timeout=90,
    )
    async def run(c, s, a, b):  # type: ignore[no-untyped-def]
        await accelsched.register(c, **FAST)
        A = a.worker_address
        await wait_for(lambda: gpus(s, A) == 1)
        kept = await c.scatter({"kept": 42}, workers=[A])
        with dask.annotate(resources={"GPU": 1}):
            leak = c.submit(leaky, 1, key="leaky-1")
        await wait_for(lambda: events(s, "restart"), timeout=30)
        g.fail(0)  # from the restart's admission on: the new process starts during it
        (restart,) = events(s, "restart")
        assert restart["worker"] == A and restart["reason"] == "leak"
        path = str(tmp_path / "runs")
        with dask.annotate(resources={"GPU": 1}):  # strict: no GPU anywhere until it is back
            futures = c.map(ran_on_gpu, [path] * 8, range(8), key=[f"g-{i}" for i in range(8)])
        await wait_for(lambda: len(s.workers) == 2 and A not in s.workers, timeout=30)
        (new,) = set(s.workers) - {b.worker_address}
        for _ in range(200):  # the new process took its inventory while the fault lasted
            if (await c.run(left_out, workers=[new]))[new] == [0]:
                break
            await asyncio.sleep(0.05)
        assert (await c.run(left_out, workers=[new]))[new] == [0]
        assert gpus(s, new) == 0 and all(f.status == "pending" for f in futures)
        assert len(events(s, "restart")) == 1  # the fault restarts nothing more
        g.recover()
        await wait_for(lambda: gpus(s, new) == 1 and events(s, "gpu-recovered"), timeout=30)
        (recovered,) = events(s, "gpu-recovered")
        assert recovered["worker"] == new and recovered["device"] == 0
        assert recovered["uuid"] == g.uuids[0]
        assert any(e["worker"] == new for e in events(s, "gpu-verified"))  # the grant path
        (status,) = [w for w in status_snapshot(s)["workers"] if w["address"] == new]
        assert [d["uuid"] for d in status["devices"]] == [g.uuids[0]] and status["gpus"] == 1
        assert await c.gather(futures) == [0] * 8
        with open(path) as f:
            assert sorted(int(line) for line in f) == list(range(8))  # each ran once
        assert await kept["kept"] == 42
        assert await leak == 1

    with fake_gpus(2) as g:
        run()


def test_a_device_back_but_not_granted_is_reported_again_until_it_is() -> None:
    """A left-out device that answers again is reported to the scheduler; a report that
    does not get it granted (the scheduler busy with the same fault's restarts) is made
    again, with backoff, not given up on: the device came back once and stayed out for
    good otherwise. The scheduler and the inventory are stand-ins (only their answers
    matter here); the device's answers are the fake NVML's."""
    from accelsched.worker.leak_check import WorkerActor

    with fake_gpus(1) as g:
        monitor = NVMLMonitor(env={})
        g.fail(0)
        assert monitor.devices() == [] and monitor.left_out == [0]
        g.recover()
        replies = ["busy", "busy", "OK"]  # what the scheduler answers, report by report
        reported: list[float] = []
        emitted: list[tuple[str, dict]] = []
        now = [0.0]

        class Inventory:  # what the actor's rejoin uses of the worker's Inventory
            def __init__(self) -> None:
                self.monitor = monitor
                self.granted: list = []
                self.health = DeviceHealth(streak=1, first=1.0)  # probed every 1 s

            def rejoin(self, info) -> None:  # type: ignore[no-untyped-def]
                monitor.adopt(info)

        inventory = Inventory()

        async def report() -> dict:
            reported.append(now[0])
            status = replies.pop(0)
            if status == "OK":
                inventory.granted = list(monitor.devices())
            return {"status": status}

        pending: list = []
        actor = WorkerActor(
            inventory=inventory,  # type: ignore[arg-type]
            set_devices=lambda usable: None,
            report=report,
            spawn=lambda fn, *args: pending.append(fn(*args)),
            emit=lambda action, **fields: emitted.append((action, fields)),
            clock=lambda: now[0],
        )
        for t in range(40):
            now[0] = float(t)
            actor.rejoin()
            while pending:
                asyncio.run(pending.pop())
        # back at its first probe (1 s), reported then, again 1 s and 2 s later: granted
        assert reported == [1.0, 2.0, 4.0]
        assert emitted == [("gpu-recovered", {"device": 0, "uuid": g.uuids[0]})]
        assert inventory.health.waiting == []
