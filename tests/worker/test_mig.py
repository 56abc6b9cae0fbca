"""MIG: workers on MIG devices (``CUDA_VISIBLE_DEVICES=MIG-<uuid>``), on fake GPUs.

The fake NVML enumerates MIG devices under their parent GPU as the real library does;
the real pynvml reads them, and real nanny processes run on them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import dask
import pynvml
import pytest
from distributed import Nanny, wait
from distributed.utils_test import gen_cluster

import accelsched
from accelsched.devices import NVMLMonitor, Visible, resolve_devices
from accelsched.policy.requests import owned
from accelsched.testing import FakeGPUs, device_alloc, fake_gpus, state
from tests.utils import (
    CTX,
    FAST,
    GiB,
    MiB,
    cvd,
    device_result,
    events,
    gpus,
    leaky,
    verified_now,
    wait_for,
)

CPU_ONLY = [("127.0.0.1", 1, cvd(""))]


@pytest.fixture(autouse=True)
def mig_gpus() -> Iterator[FakeGPUs]:
    """GPU 0 in MIG mode with two 3g.40gb devices; GPU 1 whole (not in MIG mode)."""
    with fake_gpus(2, "80GiB", names="NVIDIA H100 80GB HBM3", mig=[["3g.40gb"] * 2, None]) as g:
        yield g


def migs() -> list[state.FakeMig]:
    """The MIG devices of the session in effect (for tests that take no fixture)."""
    path = state.state_dir()
    assert path is not None
    return state.read_slots(path)[1]


# ---- CUDA_VISIBLE_DEVICES with MIG devices ----

GPUS = ["GPU-aaaa", "GPU-bbbb", "GPU-cccc"]
UNDER = {0: ["MIG-a0", "MIG-a1"], 2: []}  # GPU 0: two MIG devices; GPU 2: MIG mode, none


@pytest.mark.parametrize(
    "value, expected",
    [
        (None, [Visible(0, "MIG-a0"), Visible(1)]),  # like CUDA: one MIG device, GPU 2 empty
        ("MIG-a1", [Visible(0, "MIG-a1")]),
        ("MIG-a0,MIG-a1", [Visible(0, "MIG-a0")]),  # CUDA enumerates one MIG device only
        ("1,MIG-a1,MIG-a0", [Visible(1), Visible(0, "MIG-a1")]),
        ("0", [Visible(0, "MIG-a0")]),  # a GPU in MIG mode stands for its first MIG device
        ("GPU-aaaa,MIG-a0", [Visible(0, "MIG-a0")]),  # the same device twice: list ends
        ("MIG-zz,1", []),  # names no device: list ends
        ("2,1", [Visible(1)]),  # MIG mode without a MIG device: nothing to use
    ],
)
def test_visible_devices_as_cuda_enumerates_them(value, expected) -> None:
    entries = None if value is None else value.split(",")
    assert resolve_devices(entries, GPUS, UNDER) == expected


def test_a_second_mig_device_is_left_out_with_a_warning(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="accelsched.devices"):
        resolve_devices(["MIG-a0", "MIG-a1"], GPUS, UNDER)
    assert "second MIG device" in caplog.text and "MIG-a1" in caplog.text


# ---- the monitor ----


@pytest.mark.parametrize("nvml", ["library", "standin"])
def test_monitor_sees_the_mig_device_and_its_memory(
    nvml: str, mig_gpus: FakeGPUs, monkeypatch: pytest.MonkeyPatch
) -> None:
    if nvml == "standin":
        monkeypatch.setenv(state.ENV_STANDIN, "1")
    elif mig_gpus.standin:
        pytest.skip("no C compiler: the fake library could not be built")
    first, second = mig_gpus.mig_uuids(0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"{second},{mig_gpus.uuids[1]}")
    m = NVMLMonitor()
    mig, whole = m.devices()
    assert (mig.index, mig.nvml_index, mig.uuid, mig.parent) == (0, 0, second, mig_gpus.uuids[0])
    assert (mig.name, mig.memory) == ("NVIDIA H100 80GB HBM3 MIG 3g.40gb", 40 * GiB)
    assert (whole.index, whole.uuid, whole.parent, whole.memory) == (
        1,
        mig_gpus.uuids[1],
        None,
        80 * GiB,
    )
    buf = device_alloc(100 * MiB, device=0)  # CUDA device 0: the MIG device
    reading = m.process_memory(0)
    assert reading.exact and reading.has_context and reading.nbytes == CTX + 100 * MiB
    assert m.used(0) == CTX + 100 * MiB
    assert m.process_memory(1).nbytes == 0 and m.used(1) == 0
    # the other MIG device of the same GPU holds none of it
    other = NVMLMonitor(env={"CUDA_VISIBLE_DEVICES": first})
    assert other.devices()[0].uuid == first and other.process_memory(0).nbytes == 0
    del buf


def test_a_mig_device_is_full_at_its_own_size(monkeypatch: pytest.MonkeyPatch) -> None:
    from accelsched.testing import OutOfDeviceMemory

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", migs()[0].uuid)
    with pytest.raises(OutOfDeviceMemory, match="of 42949672960 bytes free"):
        device_alloc(41 * GiB, device=0)  # the GPU has 80 GiB; its MIG device 40


def test_dask_cuda_workers_own_their_first_mig_device() -> None:
    a, b = (m.uuid for m in migs())
    visible = NVMLMonitor(env={"CUDA_VISIBLE_DEVICES": f"{b},{a}"}).devices()
    assert [d.uuid for d in owned(visible, under_dask_cuda=True)] == [b]


# ---- workers on MIG devices ----


def _bound(i: int) -> object:
    """A GPU task: memory kept on its device, carrying that device's CUDA index and UUID."""
    device = accelsched.current_device()
    assert device is not None
    uuid = NVMLMonitor().devices()[device].uuid
    return device_alloc(64 * MiB, value=(device, uuid))


def _value(buffer) -> object:  # type: ignore[no-untyped-def]
    return buffer.value


async def _nanny(s, devices: str, gpus_declared: int = 1) -> Nanny:  # type: ignore[no-untyped-def]
    return await Nanny(s.address, nthreads=2, **cvd(devices, resources={"GPU": gpus_declared}))


@gen_cluster(client=True, Worker=Nanny, nthreads=CPU_ONLY, timeout=60)
async def test_workers_on_mig_devices_are_verified_placed_and_bound(c, s, cpu):
    first, second = migs()
    await accelsched.register(c)
    async with await _nanny(s, first.uuid) as a, await _nanny(s, second.uuid) as b:
        await wait_for(lambda: all(gpus(s, n.worker_address) == 1 for n in (a, b)))
        verified = {e["worker"]: e for e in events(s, "gpu-verified")}
        for nanny, mig in ((a, first), (b, second)):
            (device,) = verified[nanny.worker_address]["devices"]
            assert device == {
                "index": 0,
                "uuid": mig.uuid,
                "name": mig.name,
                "memory": 40 * GiB,
                "capability": (9, 0),  # its GPU's
                "mig": True,
            }
        assert gpus(s, cpu.worker_address) == 0

        with dask.annotate(resources={"GPU": 1}):
            futures = c.map(_bound, range(8))
        await wait(futures)
        where = {f.key: s.tasks[f.key].who_has for f in futures}
        assert all(len(w) == 1 for w in where.values())
        on = {next(iter(w)).address for w in where.values()}
        assert on <= {a.worker_address, b.worker_address}  # never the CPU worker
        by_worker = {a.worker_address: first.uuid, b.worker_address: second.uuid}
        for f in futures:  # read where each result lies: nothing moves, nothing reallocates
            holder = next(iter(where[f.key])).address
            device, uuid = await c.submit(_value, f, workers=[holder])
            assert (device, uuid) == (0, by_worker[holder])

        # the kept buffers count against each worker's own MIG device and the parent GPU
        pynvml.nvmlInit()
        try:
            used = {
                m.uuid: pynvml.nvmlDeviceGetMemoryInfo(
                    pynvml.nvmlDeviceGetHandleByUUID(m.uuid)
                ).used
                for m in (first, second)
            }
            parent = pynvml.nvmlDeviceGetHandleByIndex(first.parent)
            parent_used = pynvml.nvmlDeviceGetMemoryInfo(parent).used
        finally:
            pynvml.nvmlShutdown()
        for addr, uuid in by_worker.items():
            kept = sum(1 for w in where.values() if next(iter(w)).address == addr)
            assert used[uuid] == (CTX + kept * 64 * MiB if kept else 0)
        assert parent_used == sum(used.values())


@gen_cluster(client=True, Worker=Nanny, nthreads=CPU_ONLY, timeout=60)
async def test_two_mig_uuids_in_one_worker_offer_one_gpu(c, s, cpu):
    first, second = migs()
    await accelsched.register(c)
    async with await _nanny(s, f"{first.uuid},{second.uuid}", gpus_declared=2) as a:
        await wait_for(lambda: events(s, "gpu-corrected") and gpus(s, a.worker_address) == 1)
        (corrected,) = events(s, "gpu-corrected")
        assert corrected["worker"] == a.worker_address
        assert (corrected["declared"], corrected["granted"]) == (2, 1)
        assert corrected["reason"] == "fewer-devices"
        (verified,) = events(s, "gpu-verified")
        assert [d["uuid"] for d in verified["devices"]] == [first.uuid]


@gen_cluster(client=True, Worker=Nanny, nthreads=CPU_ONLY, timeout=60)
async def test_one_owner_per_mig_device(c, s, cpu):
    """One worker names the MIG device by UUID, the other by its parent's index."""
    first, _ = migs()
    await accelsched.register(c)
    async with await _nanny(s, first.uuid) as a:
        await wait_for(lambda: gpus(s, a.worker_address) == 1)
        async with await _nanny(s, "0") as b:
            await wait_for(lambda: events(s, "gpu-rejected"))
            (rejected,) = events(s, "gpu-rejected")
            assert rejected["worker"] == b.worker_address
            assert rejected["owner"] == a.worker_address
            assert list(rejected["uuids"]) == [first.uuid]
            assert gpus(s, b.worker_address) == 0


@gen_cluster(client=True, Worker=Nanny, nthreads=CPU_ONLY, timeout=90)
async def test_a_leak_on_a_mig_device_restarts_only_that_worker(c, s, cpu):
    first, second = migs()
    await accelsched.register(c, **FAST)
    async with await _nanny(s, first.uuid) as a, await _nanny(s, second.uuid) as b:
        await wait_for(lambda: all(gpus(s, n.worker_address) == 1 for n in (a, b)))
        target, peer = a.worker_address, b.worker_address
        with dask.annotate(resources={"GPU": 1}):
            kept = c.submit(device_result, 7, key="kept", workers=[target])
            await kept
            await c.submit(leaky, 1, key="leaky-1", workers=[target])
        await wait_for(lambda: events(s, "restart"), timeout=30)
        (leak,) = events(s, "leak")
        assert leak["worker"] == target and leak["nbytes"] >= 512 * MiB
        (restart,) = events(s, "restart")
        assert restart["worker"] == target
        await wait_for(lambda: len(s.workers) == 3 and verified_now(s, a, b, count=1), timeout=30)
        assert b.worker_address == peer  # the other MIG device's worker was never touched
        assert a.worker_address != target
        assert (await kept).value == 7  # moved before the restart, not lost
        reverified = [e for e in events(s, "gpu-verified") if e["worker"] == a.worker_address]
        assert [d["uuid"] for d in reverified[-1]["devices"]] == [first.uuid]
