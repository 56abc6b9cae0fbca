"""accelsched.testing: fake GPUs through the real pynvml, in this process and in children."""

from __future__ import annotations

import ctypes
import json
import os
import pickle
import shutil
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pynvml
import pytest
from dask.sizeof import sizeof

from accelsched.devices import POOLS, device_nbytes
from accelsched.testing import (
    FakeGPUs,
    FakeNVMLWarning,
    OutOfDeviceMemory,
    SimulatedPool,
    build,
    create_context,
    device_alloc,
    fake_gpus,
    fixed_pool,
    liveness,
    standin,
    state,
)
from accelsched.testing import device_memory as pool_module
from tests.utils import CTX, GiB, MiB, last_json, run_python


def _nvml_on(g: FakeGPUs) -> Iterator[FakeGPUs]:
    """The real pynvml on the fake library for one test: the stand-in would not be the
    library these tests are about, so without it (no C compiler) they skip."""
    if g.standin:
        pytest.skip("no C compiler: the fake library could not be built")
    pynvml.nvmlInit()
    try:
        yield g
    finally:
        pynvml.nvmlShutdown()


@pytest.fixture
def gpus() -> Iterator[FakeGPUs]:
    with fake_gpus(2, "16GiB", names=["NVIDIA Fake A100", "NVIDIA Fake H100"]) as g:
        yield from _nvml_on(g)


def the_pool() -> SimulatedPool:
    pool = pool_module._POOL
    assert pool is not None
    return pool


def used(index: int) -> int:
    return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index)).used)


def procs(index: int) -> dict[int, int | None]:
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    return {p.pid: p.usedGpuMemory for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)}


def snapshot(nvml: Any) -> dict[str, Any]:
    """What accelsched's monitor reads, from pynvml or the stand-in."""
    out: dict[str, Any] = {"driver": nvml.nvmlSystemGetDriverVersion(), "devices": []}
    for i in range(nvml.nvmlDeviceGetCount()):
        h = nvml.nvmlDeviceGetHandleByIndex(i)
        uuid = nvml.nvmlDeviceGetUUID(h)
        mem = nvml.nvmlDeviceGetMemoryInfo(h)
        processes = nvml.nvmlDeviceGetComputeRunningProcesses(h)
        out["devices"].append(
            {
                "index": nvml.nvmlDeviceGetIndex(nvml.nvmlDeviceGetHandleByUUID(uuid)),
                "name": nvml.nvmlDeviceGetName(h),
                "uuid": uuid,
                "memory": (mem.total, mem.used, mem.free),
                "processes": sorted((p.pid, p.usedGpuMemory) for p in processes),
            }
        )
    return out


# ---- the fake library through the real pynvml ----


def test_pynvml_sees_the_fake_gpus(gpus: FakeGPUs) -> None:
    assert pynvml.nvmlDeviceGetCount() == 2
    assert pynvml.nvmlSystemGetDriverVersion() == "555.42.06"
    assert pynvml.nvmlSystemGetCudaDriverVersion() == 12050
    assert pynvml.nvmlSystemGetCudaDriverVersion_v2() == 12050
    assert pynvml.nvmlSystemGetNVMLVersion().startswith("12.")
    for i, (uuid, name) in enumerate(zip(gpus.uuids, gpus.names, strict=True)):
        assert uuid.startswith("GPU-") and len(uuid) == 40
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        assert pynvml.nvmlDeviceGetUUID(h) == uuid
        assert pynvml.nvmlDeviceGetName(h) == name
        assert pynvml.nvmlDeviceGetIndex(pynvml.nvmlDeviceGetHandleByUUID(uuid)) == i
        mem = pynvml.nvmlDeviceGetMemoryInfo(h)
        assert (mem.total, mem.used, mem.free) == (16 * GiB, 0, 16 * GiB)
        v2 = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
        assert (v2.total, v2.reserved, v2.used, v2.free) == (16 * GiB, 0, 0, 16 * GiB)
        util = pynvml.nvmlDeviceGetUtilizationRates(h)
        assert (util.gpu, util.memory) == (0, 0)
        assert pynvml.nvmlDeviceGetComputeRunningProcesses(h) == []
        with pytest.raises(pynvml.NVMLError_NotSupported):
            pynvml.nvmlDeviceGetMigMode(h)
    assert gpus.uuids[0] != gpus.uuids[1]
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlDeviceGetHandleByIndex(2)
    with pytest.raises(pynvml.NVMLError_NotFound):
        pynvml.nvmlDeviceGetHandleByUUID("GPU-00000000-0000-0000-0000-000000000000")
    with pytest.raises(pynvml.NVMLError_ArgumentVersionMismatch):
        pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0), version=7)
    assert pynvml.nvmlErrorString(pynvml.NVML_ERROR_DRIVER_NOT_LOADED) == "Driver Not Loaded"


def test_running_processes_every_struct_version(gpus: FakeGPUs) -> None:
    buf = device_alloc(10 * MiB, device=1)
    me = os.getpid()
    h = pynvml.nvmlDeviceGetHandleByIndex(1)
    for fn in (
        pynvml.nvmlDeviceGetComputeRunningProcesses_v2,
        pynvml.nvmlDeviceGetComputeRunningProcesses_v3,
    ):
        (p,) = fn(h)
        assert (p.pid, p.usedGpuMemory) == (me, CTX + 10 * MiB)
        assert (p.gpuInstanceId, p.computeInstanceId) == (2**32 - 1, 2**32 - 1)
    assert procs(0) == {}
    assert pynvml.nvmlDeviceGetGraphicsRunningProcesses(h) == []

    # v1 (16-byte structs), not wrapped by pynvml 13; count-query protocol by hand
    class ProcV1(ctypes.Structure):
        _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong)]

    assert ctypes.sizeof(ProcV1) == 16
    fn = pynvml._nvmlGetFunctionPointer("nvmlDeviceGetComputeRunningProcesses")
    count = ctypes.c_uint(0)
    assert fn(h, ctypes.byref(count), None) == pynvml.NVML_ERROR_INSUFFICIENT_SIZE
    assert count.value == 1
    array = (ProcV1 * 3)()
    count.value = 3
    assert fn(h, ctypes.byref(count), array) == pynvml.NVML_SUCCESS
    assert (count.value, array[0].pid, array[0].usedGpuMemory) == (1, me, CTX + 10 * MiB)
    assert array[1].pid == 0  # nothing written past the count
    del buf


def test_distributed_diagnostics(gpus: FakeGPUs) -> None:
    from distributed.diagnostics import nvml

    create_context(device=0)
    device_alloc(5 * MiB, device=0, leak=True)
    assert nvml.one_time() == {"memory-total": 16 * GiB, "name": "NVIDIA Fake A100"}
    assert nvml.real_time() == {"utilization": 0, "memory-used": CTX + 5 * MiB}
    ctx = nvml.has_cuda_context()
    assert ctx.has_context and ctx.device_info.uuid == gpus.uuids[0]
    assert nvml.get_device_index_and_uuid(gpus.uuids[1]).device_index == 1
    assert nvml.get_device_mig_mode(0) == [0, 0]


def test_no_state_dir_means_driver_not_loaded(gpus: FakeGPUs) -> None:
    env = {k: v for k, v in os.environ.items() if k != state.ENV_DIR}
    result = subprocess.run(
        [sys.executable, "-c", "import pynvml; pynvml.nvmlInit()"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "NVMLError_DriverNotLoaded" in result.stderr


def test_child_process_and_dead_child(gpus: FakeGPUs) -> None:
    """A child sees the same GPUs; its CUDA_VISIBLE_DEVICES maps allocations; death frees."""
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                """
                import json, sys, pynvml
                from accelsched.testing import device_alloc
                pynvml.nvmlInit()
                hs = [pynvml.nvmlDeviceGetHandleByIndex(i)
                      for i in range(pynvml.nvmlDeviceGetCount())]
                buf = device_alloc(100 * 2**20, device=0)  # CUDA 0 = NVML 1 here
                print(json.dumps({
                    "uuids": [pynvml.nvmlDeviceGetUUID(h) for h in hs],
                    "names": [pynvml.nvmlDeviceGetName(h) for h in hs],
                    "total": [pynvml.nvmlDeviceGetMemoryInfo(h).total for h in hs],
                }), flush=True)
                sys.stdin.read()
                """
            ),
        ],
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "1"},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdin is not None
        seen = json.loads(child.stdout.readline())
        assert seen == {
            "uuids": list(gpus.uuids),
            "names": list(gpus.names),
            "total": [16 * GiB] * 2,
        }
        assert procs(1) == {child.pid: CTX + 100 * MiB}
        assert (used(0), used(1)) == (0, CTX + 100 * MiB)
    finally:
        child.communicate("", timeout=60)
    assert procs(1) == {} and used(1) == 0
    assert (gpus.path / "proc" / str(child.pid)).exists()  # ignored: the pid is dead


def test_nanny_worker_sees_fake_gpus(gpus: FakeGPUs) -> None:
    from distributed import Client, LocalCluster

    def work() -> tuple[int, str, int]:
        from distributed.diagnostics import nvml

        device_alloc(3 * MiB, device=0, leak=True)
        return os.getpid(), nvml.one_time()["name"], nvml.real_time()["memory-used"]

    with (
        LocalCluster(
            n_workers=1, threads_per_worker=1, processes=True, dashboard_address=":0"
        ) as cluster,
        Client(cluster) as client,
    ):
        pid, name, memory = client.submit(work).result()
        assert pid != os.getpid()
        assert (name, memory) == ("NVIDIA Fake A100", CTX + 3 * MiB)
        assert procs(0) == {pid: CTX + 3 * MiB}


# ---- the simulated pool ----


def test_pool_caches_until_free_all(gpus: FakeGPUs) -> None:
    a = device_alloc(100 * MiB, device=0, value="payload")
    pool = the_pool()
    assert pool in POOLS and pool.active()
    assert (a.device, a.nbytes, a.value) == (0, 100 * MiB, "payload")
    assert sizeof(a) == 100 * MiB and device_nbytes([a]) == {0: 100 * MiB}
    assert used(0) == CTX + 100 * MiB
    del a  # returned to the cache: NVML still counts it
    assert pool.stats(0).held == 100 * MiB and pool.stats(0).cached == 100 * MiB
    assert used(0) == CTX + 100 * MiB
    b = device_alloc(40 * MiB, device=0)  # served from the cache
    assert (pool.stats(0).held, pool.stats(0).cached) == (100 * MiB, 60 * MiB)
    assert pool.free_all() == 60 * MiB
    assert used(0) == CTX + 40 * MiB
    b.free()
    assert b.device is None and device_nbytes(b) == {}
    b.free()  # idempotent
    assert pool.free_all() == 40 * MiB
    assert used(0) == CTX  # the context stays until the process dies
    assert pool.stats(1) == pool.stats(1).__class__()


def test_leaks_are_never_released(gpus: FakeGPUs) -> None:
    device_alloc(30 * MiB, device=1, leak=True)
    assert the_pool().free_all() == 0
    assert used(1) == CTX + 30 * MiB
    assert the_pool().stats(1).cached == 0


def test_fixed_pool_is_reserved_and_constant(gpus: FakeGPUs) -> None:
    fixed_pool(GiB, device=1)
    pool = the_pool()
    assert used(1) == CTX + GiB
    bufs = [device_alloc(300 * MiB, device=1) for _ in range(3)]
    assert used(1) == CTX + GiB
    extra = device_alloc(300 * MiB, device=1)  # no room left in the fixed pool
    assert used(1) == CTX + GiB + 300 * MiB
    del bufs, extra
    assert pool.free_all() == 300 * MiB
    assert used(1) == CTX + GiB
    stats = pool.stats(1)
    assert (stats.held, stats.cached, stats.fixed) == (GiB, 0, GiB)
    fixed_pool(GiB, device=1)  # same size: no-op
    with pytest.raises(ValueError, match="cannot be resized"):
        fixed_pool(2 * GiB, device=1)


def test_out_of_memory_frees_the_cache_first() -> None:
    with fake_gpus(1, "1GiB", context_memory=0) as g:
        if g.standin:
            pytest.skip("no C compiler")
        a = device_alloc(700 * MiB, device=0)
        b = device_alloc(200 * MiB, device=0)
        with pytest.raises(OutOfDeviceMemory, match="fake GPU 0"):
            device_alloc(400 * MiB, device=0)
        del a  # cached, too small for the next one, which fits only once the cache is freed
        c = device_alloc(800 * MiB, device=0)
        assert the_pool().stats(0).held == 1000 * MiB
        assert used(0) == 1000 * MiB
        del b, c


def test_threads_allocate_and_free_consistently(gpus: FakeGPUs) -> None:
    def churn() -> None:
        for _ in range(50):
            bufs = [device_alloc(MiB, device=0) for _ in range(3)]
            del bufs

    threads = [threading.Thread(target=churn) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stats = the_pool().stats(0)
    assert stats.held == stats.cached  # nothing in use
    assert used(0) == CTX + stats.held


def test_pickle_reallocates_or_detaches(gpus: FakeGPUs) -> None:
    a = device_alloc(10 * MiB, device=1, value={"x": 1})
    b = pickle.loads(pickle.dumps(a))
    assert (b.device, b.nbytes, b.value) == (1, 10 * MiB, {"x": 1})
    assert used(1) == CTX + 20 * MiB
    out = run_python(
        textwrap.dedent(
            f"""
            import json, pickle
            b = pickle.loads({pickle.dumps(a)!r})
            print(json.dumps([b.device, b.nbytes, b.value]))
            """
        ),
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "0"},  # one device: CUDA index 1 is not visible
    )
    child = last_json(out)
    assert child == [None, 10 * MiB, {"x": 1}]
    del a, b


def test_pickle_outside_fake_gpus_detaches() -> None:
    with fake_gpus(1) as g:
        if g.standin:
            pytest.skip("no C compiler")
        data = pickle.dumps(device_alloc(MiB, device=0, value=3))
    buf = pickle.loads(data)
    assert (buf.device, buf.nbytes, buf.value, device_nbytes(buf)) == (None, MiB, 3, {})
    assert not the_pool().active() and the_pool().stats(0).held == 0  # the session ended


def test_to_host_gives_a_detached_buffer(gpus: FakeGPUs) -> None:
    from accelsched import devices

    if not hasattr(devices, "to_host"):
        pytest.skip("no to_host dispatch")
    buf = device_alloc(MiB, device=0, value=[1, 2])
    host = devices.to_host(buf)
    assert (host.device, host.nbytes, host.value) == (None, MiB, [1, 2])
    assert buf.device == 0


def test_current_device_from_the_task_lease(gpus: FakeGPUs) -> None:
    from accelsched.context import Lease, bind, unbind

    bound = bind(Lease(key="k", devices=(1,)))  # as the guard binds a GPU task
    try:
        buf = device_alloc(MiB)
        create_context()
    finally:
        unbind(bound)
    assert buf.device == 1 and used(1) == CTX + MiB


# ---- flags ----


def test_no_process_memory(gpus: FakeGPUs) -> None:
    device_alloc(MiB, device=0, leak=True)
    gpus.set_flags(process_memory=False)
    assert procs(0) == {os.getpid(): None}
    assert used(0) == CTX + MiB  # device-wide memory is still known
    standin.nvmlInit()
    try:
        (p,) = standin.nvmlDeviceGetComputeRunningProcesses(standin.nvmlDeviceGetHandleByIndex(0))
        assert p.usedGpuMemory is None
    finally:
        standin.nvmlShutdown()


def test_pid_offset(gpus: FakeGPUs) -> None:
    from distributed.diagnostics import nvml

    create_context(device=0)
    gpus.set_flags(pid_offset=1000)
    assert procs(0) == {os.getpid() + 1000: CTX}
    assert not nvml.has_cuda_context().has_context  # as in a container
    gpus.set_flags(pid_offset=0)
    assert nvml.has_cuda_context().has_context


HOLDER = textwrap.dedent(
    """
    import sys
    from accelsched.testing import device_alloc
    buf = device_alloc(100 * 2**20, device=0)
    print("allocated", flush=True)
    sys.stdin.read()
    """
)


def _holder() -> subprocess.Popen:
    """A process holding 100 MiB (and a context) on GPU 0, until its stdin closes."""
    child = subprocess.Popen(
        [sys.executable, "-c", HOLDER],
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "0"},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None and child.stdout.readline() == "allocated\n"
    return child


def test_an_ended_process_holds_nothing_even_when_its_pid_is_reused(gpus: FakeGPUs) -> None:
    """The driver frees an ended process's memory. Before, the fake kept counting a
    killed process's record whenever a later process got its pid (pids wrap at
    ``pid_max``, 32768 on many machines, within minutes under the leak benchmark's
    churn: a device showed a leak nobody held), and while the ended process was a
    zombie. A pid cannot be reused on purpose: the record is moved onto the pid of a
    live process that never touched a GPU, the state pid reuse leaves on disk."""
    child = _holder()
    child.kill()  # no clean-up: its record stays behind
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # ended, left unreaped
    try:
        # a zombie (killed, not yet reaped) holds nothing
        assert liveness.alive(child.pid) is False
        assert procs(0) == {} and used(0) == 0
        assert state.read_procs(gpus.path) == {}
    finally:
        child.wait()
        child.communicate()
    stale = gpus.path / "proc" / str(child.pid)
    assert stale.read_text().startswith("start ")  # who wrote it, besides what it held
    later = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    try:
        stale.rename(gpus.path / "proc" / str(later.pid))
        assert liveness.alive(later.pid) and procs(0) == {} and used(0) == 0
        assert state.read_procs(gpus.path) == {}
        standin.nvmlInit()
        try:
            assert snapshot(standin) == snapshot(pynvml)
        finally:
            standin.nvmlShutdown()
        # the live holder itself is counted, by both
        holder = _holder()
        try:
            assert procs(0) == {holder.pid: CTX + 100 * MiB}
            assert state.read_procs(gpus.path) == {holder.pid: {0: CTX + 100 * MiB}}
        finally:
            holder.communicate("", timeout=60)
    finally:
        later.communicate(b"", timeout=60)


# ---- the pure-Python stand-in ----


def test_standin_gives_the_same_answers(gpus: FakeGPUs) -> None:
    device_alloc(7 * MiB, device=1, leak=True)
    standin.nvmlInit()
    try:
        assert snapshot(standin) == snapshot(pynvml)
        for nvml in (standin, pynvml):
            h = nvml.nvmlDeviceGetHandleByIndex(0)
            v2 = nvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
            assert (v2.total, v2.used) == (16 * GiB, 0)
            assert nvml.nvmlDeviceGetUtilizationRates(h).gpu == 0
            with pytest.raises(pynvml.NVMLError_NotSupported):
                nvml.nvmlDeviceGetMigMode(h)
            with pytest.raises(pynvml.NVMLError_InvalidArgument):
                nvml.nvmlDeviceGetHandleByIndex(5)
            with pytest.raises(pynvml.NVMLError_NotFound):
                nvml.nvmlDeviceGetHandleByUUID("GPU-nope")
        with pytest.raises(standin.NVMLError_FunctionNotFound):
            standin.nvmlDeviceGetPowerUsage(standin.StandinHandle(0))
        assert not standin.active()
    finally:
        standin.nvmlShutdown()


def test_standin_without_a_compiler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("ACCELSCHED_CACHE_DIR", str(tmp_path / "cache"))
    assert build.library_dir() is None
    with pytest.warns(FakeNVMLWarning, match="stand-in"), fake_gpus(1, "8GiB", names="X") as g:
        assert g.standin and g.library is None
        assert g.env[state.ENV_STANDIN] == "1" and "LD_LIBRARY_PATH" not in g.env
        assert standin.active()
        standin.nvmlInit()
        try:
            buf = device_alloc(2 * MiB, device=0)
            snap = snapshot(standin)
            assert snap["devices"] == [
                {
                    "index": 0,
                    "name": "X",
                    "uuid": g.uuids[0],
                    "memory": (8 * GiB, CTX + 2 * MiB, 8 * GiB - CTX - 2 * MiB),
                    "processes": [(os.getpid(), CTX + 2 * MiB)],
                }
            ]
            del buf
        finally:
            standin.nvmlShutdown()
    assert not standin.active()
    with pytest.raises(pynvml.NVMLError_DriverNotLoaded):
        standin.nvmlInit()


# ---- MIG ----


@pytest.fixture
def mig() -> Iterator[FakeGPUs]:
    """GPU 0 in MIG mode (a 4g.40gb and a 3g.40gb device), GPU 1 whole."""
    with fake_gpus(
        2, "80GiB", names="NVIDIA A100-SXM4-80GB", mig=[["4g.40gb", "3g.40gb"], None]
    ) as g:
        yield from _nvml_on(g)


def mig_snapshot(nvml: Any) -> list[Any]:
    """Every MIG query the monitor and distributed make, from pynvml or the stand-in."""
    out: list[Any] = []
    for i in range(nvml.nvmlDeviceGetCount()):
        h = nvml.nvmlDeviceGetHandleByIndex(i)
        try:
            mode = nvml.nvmlDeviceGetMigMode(h)
        except pynvml.NVMLError_NotSupported:
            out.append((i, "no MIG", nvml.nvmlDeviceIsMigDeviceHandle(h).value))
            continue
        mem = nvml.nvmlDeviceGetMemoryInfo(h)
        out.append((i, mode, nvml.nvmlDeviceGetMaxMigDeviceCount(h), mem.total, mem.used))
        for k in range(nvml.nvmlDeviceGetMaxMigDeviceCount(h)):
            try:
                m = nvml.nvmlDeviceGetMigDeviceHandleByIndex(h, k)
            except pynvml.NVMLError_NotFound:
                continue
            mem = nvml.nvmlDeviceGetMemoryInfo(m)
            parent = nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(m)
            processes = nvml.nvmlDeviceGetComputeRunningProcesses(m)
            out.append(
                {
                    "uuid": nvml.nvmlDeviceGetUUID(m),
                    "name": nvml.nvmlDeviceGetName(m),
                    "memory": (mem.total, mem.used, mem.free),
                    "ids": (
                        nvml.nvmlDeviceGetGpuInstanceId(m),
                        nvml.nvmlDeviceGetComputeInstanceId(m),
                    ),
                    "is_mig": nvml.nvmlDeviceIsMigDeviceHandle(m).value,
                    "index": nvml.nvmlDeviceGetIndex(m),
                    "parent": nvml.nvmlDeviceGetUUID(parent),
                    "by_uuid": nvml.nvmlDeviceGetName(
                        nvml.nvmlDeviceGetHandleByUUID(nvml.nvmlDeviceGetUUID(m))
                    ),
                    "processes": [(p.pid, p.usedGpuMemory, p.gpuInstanceId) for p in processes],
                }
            )
        out.append(
            sorted(
                (p.pid, p.usedGpuMemory, p.gpuInstanceId)
                for p in nvml.nvmlDeviceGetComputeRunningProcesses(h)
            )
        )
    return out


def test_mig_devices_are_enumerated_under_their_parent(mig: FakeGPUs) -> None:
    assert pynvml.nvmlDeviceGetCount() == 2  # MIG devices are not in the device count
    gpu, whole = pynvml.nvmlDeviceGetHandleByIndex(0), pynvml.nvmlDeviceGetHandleByIndex(1)
    assert pynvml.nvmlDeviceGetMigMode(gpu) == [pynvml.NVML_DEVICE_MIG_ENABLE] * 2
    assert pynvml.nvmlDeviceGetMaxMigDeviceCount(gpu) == 7
    first, second = mig.mig
    assert (first.parent, second.parent) == (0, 0) and mig.mig_uuids(0) == (first.uuid, second.uuid)
    assert mig.mig_uuids(1) == ()
    assert mig_snapshot(pynvml)[:3] == [
        (0, [1, 1], 7, 80 * GiB, 0),
        {
            "uuid": first.uuid,
            "name": "NVIDIA A100-SXM4-80GB MIG 4g.40gb",
            "memory": (40 * GiB, 0, 40 * GiB),
            "ids": (1, 0),
            "is_mig": 1,
            "index": 0,
            "parent": mig.uuids[0],
            "by_uuid": "NVIDIA A100-SXM4-80GB MIG 4g.40gb",
            "processes": [],
        },
        {
            "uuid": second.uuid,
            "name": "NVIDIA A100-SXM4-80GB MIG 3g.40gb",
            "memory": (40 * GiB, 0, 40 * GiB),
            "ids": (2, 0),
            "is_mig": 1,
            "index": 0,
            "parent": mig.uuids[0],
            "by_uuid": "NVIDIA A100-SXM4-80GB MIG 3g.40gb",
            "processes": [],
        },
    ]
    assert first.uuid.startswith("MIG-") and len(first.uuid) == 40
    assert pynvml.nvmlDeviceIsMigDeviceHandle(gpu).value == 0
    with pytest.raises(pynvml.NVMLError_NotFound):
        pynvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, 2)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, 7)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(gpu)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetGpuInstanceId(gpu)
    for not_mig in (whole, pynvml.nvmlDeviceGetHandleByUUID(first.uuid)):
        with pytest.raises(pynvml.NVMLError_NotSupported):
            pynvml.nvmlDeviceGetMigMode(not_mig)
        with pytest.raises(pynvml.NVMLError_NotSupported):
            pynvml.nvmlDeviceGetMigDeviceHandleByIndex(not_mig, 0)
    with pytest.raises(pynvml.NVMLError_NotSupported):  # as on real GPUs in MIG mode
        pynvml.nvmlDeviceGetUtilizationRates(gpu)
    assert pynvml.nvmlDeviceGetUtilizationRates(whole).gpu == 0
    mig.lose(0)  # a GPU that falls off the bus takes its MIG devices with it
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByUUID(second.uuid))


def test_mig_memory_counts_against_its_device_and_the_parent(mig: FakeGPUs) -> None:
    """A child on the second MIG device allocates: NVML shows it there and on the GPU."""
    from distributed.diagnostics import nvml

    first, second = mig.mig
    code = """
        import json, os
        from accelsched.testing import device_alloc
        from distributed.diagnostics import nvml
        buf = device_alloc(100 * 2**20, device=0)
        ctx = nvml.has_cuda_context()
        print(json.dumps([os.getpid(), ctx.device_info.uuid, ctx.device_info.mig_index,
                          nvml.one_time(), nvml.real_time()]))
        """
    env = {"CUDA_VISIBLE_DEVICES": second.uuid}
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code) + "input()"],
        env={**os.environ, **env},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        pid, uuid, mig_index, one, real = json.loads(child.stdout.readline())
        assert (uuid, mig_index) == (second.uuid, 1)
        assert one == {"memory-total": 40 * GiB, "name": second.name}
        assert real == {"utilization": None, "memory-used": CTX + 100 * MiB}
        (_, *devices) = mig_snapshot(pynvml)[:3]
        assert [d["memory"][1] for d in devices] == [0, CTX + 100 * MiB]
        assert devices[1]["processes"] == [(pid, CTX + 100 * MiB, 2)]
        assert mig_snapshot(pynvml)[0] == (0, [1, 1], 7, 80 * GiB, CTX + 100 * MiB)
        assert procs(0) == {pid: CTX + 100 * MiB}
        assert procs(1) == {}
        # the stand-in reads the same state the same way
        standin.nvmlInit()
        try:
            assert mig_snapshot(standin) == mig_snapshot(pynvml)
        finally:
            standin.nvmlShutdown()
    finally:
        child.communicate("\n", timeout=60)
    assert not nvml.has_cuda_context().has_context  # this process holds nothing
    assert mig_snapshot(pynvml)[0][-1] == 0  # the child's death freed its memory


def test_mig_device_full_at_its_own_size(mig: FakeGPUs, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", mig.mig[1].uuid)
    assert the_pool_visible() == 1
    with pytest.raises(OutOfDeviceMemory, match="of 42949672960 bytes free"):
        device_alloc(40 * GiB, device=0)  # the context takes its share too
    device_alloc(GiB, device=0, leak=True)
    assert mig_snapshot(pynvml)[0][-1] == CTX + GiB


def the_pool_visible() -> int:
    from accelsched.testing.device_memory import _pool

    return _pool().visible()


# ---- the session itself ----


def test_environment_restored_and_directory_removed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LD_LIBRARY_PATH", "/opt/x")
    monkeypatch.delenv(state.ENV_STANDIN, raising=False)
    before = dict(os.environ)
    with fake_gpus(3, ["1GiB", 2 * GiB, "3GiB"]) as g:
        assert g.count == 3 and g.memory == (GiB, 2 * GiB, 3 * GiB)
        assert os.environ[state.ENV_DIR] == str(g.path)
        if not g.standin:
            assert os.environ["LD_LIBRARY_PATH"] == f"{g.library.parent}:/opt/x"  # type: ignore[union-attr]
        assert {k: os.environ[k] for k in g.env} == g.env
        with pytest.raises(RuntimeError, match="already active"), fake_gpus():
            pass
    assert dict(os.environ) == before
    assert not g.path.exists()


def test_library_builds_once_even_concurrently(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ACCELSCHED_CACHE_DIR", str(tmp_path))
    compiler = build._compiler()
    if compiler is None or shutil.which(compiler[0]) is None:
        pytest.skip("no C compiler")
    results: list[Path | None] = []
    threads = [
        threading.Thread(target=lambda: results.append(build.library_dir())) for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(results)) == 1 and results[0] is not None
    assert [p.name for p in results[0].iterdir()] == [build.SONAME]  # no leftovers
    assert results[0].parent == tmp_path


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"count": -1}, ValueError, "count"),
        ({"count": "2"}, TypeError, "count"),
        ({"count": True}, TypeError, "count"),
        ({"memory": "lots"}, ValueError, "memory"),
        ({"memory": ""}, ValueError, "memory is not a size in whole bytes: ''"),
        ({"memory": "GiB"}, ValueError, "memory is not a size in whole bytes: 'GiB'"),
        ({"memory": "1.5"}, ValueError, "memory is not a size in whole bytes: '1.5'"),
        ({"context_memory": "1.5e0"}, ValueError, "context_memory is not a size"),
        ({"memory": 0}, ValueError, "memory"),
        ({"memory": ["1GiB"]}, ValueError, "memory"),
        ({"memory": 1.5}, TypeError, "memory"),
        ({"names": ["a\tb", "c"]}, ValueError, "name"),
        # any line break the state files' reader splits at, and a NUL, where the library's
        # reader stops (before: taken; the device went, or every allocation failed)
        *(({"names": [f"a{c}b", "c"]}, ValueError, "one line") for c in "\x0b\x1c\x85\u2028\x00"),
        ({"capability": "\u00b2.0"}, ValueError, "capability must be"),  # digits, ASCII ones
        ({"count": 5, "memory": b"16GiB"}, TypeError, "memory must be one value or a sequence"),
        ({"count": 5, "memory": memoryview(b"16GiB")}, TypeError, "memory must be one value"),
        ({"capability": "\u0663.\u0660"}, ValueError, "capability must be"),
        ({"names": [1, 2]}, TypeError, "names"),
        ({"context_memory": "-1MiB"}, ValueError, "context_memory"),
        ({"memory": 2**64}, ValueError, "memory must be at most 18446744073709551615 bytes"),
        (
            {"memory": ["16GiB", "1GiB"], "context_memory": "2GiB"},
            ValueError,
            "context_memory '2GiB' is more than a device's memory",
        ),
        ({"process_memory": "no"}, TypeError, "process_memory"),
        ({"pid_offset": -5}, ValueError, "pid_offset"),
        ({"mig": "3g.40gb"}, TypeError, "mig must be None, a list"),
        ({"mig": ["3g.40"]}, ValueError, "not a MIG profile: '3g.40'"),
        ({"mig": ["5g.40gb"]}, ValueError, "not a MIG profile: '5g.40gb'"),
        ({"count": 1, "mig": [3]}, TypeError, "must be a list of MIG profiles or None, got 3"),
        ({"mig": [["1g.10gb"]]}, ValueError, "one per GPU"),
        ({"mig": [["1g.10gb"], "1g.10gb"]}, TypeError, "GPU 1 must be a list"),
        ({"mig": ["4g.8gb", "4g.8gb"]}, ValueError, "7 compute slices"),
        ({"mig": ["1g.1gb"] * 8}, ValueError, "at most 7 devices"),
        ({"count": 19, "mig": ["1g.1gb"] * 7}, ValueError, "133 MIG devices in all"),
        ({"mig": ["3g.9gb", "3g.9gb"]}, ValueError, "more memory than GPU 0"),
        ({"mig": ["1g.1gb"], "names": "N" * 90}, ValueError, "over NVML's 95 bytes"),
    ],
)
def test_bad_arguments(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match), fake_gpus(**kwargs):
        pass
    assert state.ENV_DIR not in os.environ


def test_faults_name_a_device_the_session_has(gpus: FakeGPUs) -> None:
    """``fail``, ``lose``, ``recover`` and ``mig_uuids`` refuse a device the session has
    not, naming it (before: ``recover(5)`` did nothing and ``recover(True)`` cleared
    device 1's faults, without a word; ``mig_uuids("a")`` was empty)."""
    for method in (gpus.fail, gpus.lose, gpus.recover, gpus.mig_uuids):
        with pytest.raises(ValueError, match=r"no device 5; devices are 0\.\.1"):
            method(5)
        for odd in (True, 0.0, "x"):
            with pytest.raises(TypeError, match=f"device must be an int, got {odd!r}"):
                method(odd)  # type: ignore[arg-type]
    gpus.fail(0)
    gpus.fail(1)
    gpus.recover(1)
    with pytest.raises(pynvml.NVMLError):
        pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0))
    pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(1))


def test_a_child_forked_in_a_session_leaves_it_to_its_parent() -> None:
    """A child forked inside the block that leaves it (``sys.exit``) ends nothing of its
    parent's session (before: it deleted the session's files and the parent's next
    allocation failed)."""
    child = False
    try:
        with fake_gpus(1) as g:
            child = os.fork() == 0
            if child:
                sys.exit(0)  # leaves the block, in the child alone
            os.wait()
            assert g.path.exists() and os.environ[state.ENV_DIR] == str(g.path)
            device_alloc(MiB, device=0).free()
    finally:
        if child:  # never back into pytest
            os._exit(0)
    assert not g.path.exists() and state.ENV_DIR not in os.environ


def test_bad_allocations(gpus: FakeGPUs) -> None:
    with pytest.raises(ValueError, match="-1"):
        device_alloc(-1, device=0)
    with pytest.raises(TypeError, match="1.5"):
        device_alloc(1.5, device=0)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="inside a task holding a GPU, or pass device="):
        device_alloc(1)
    with pytest.raises(ValueError, match="device 2 is not visible"):
        device_alloc(1, device=2)
    with pytest.raises(TypeError, match="device"):
        device_alloc(1, device="0")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="fixed_pool: nbytes must be more than 0, got 0"):
        fixed_pool(0, device=0)  # (before: taken, and a later fixed_pool(10) too)


def test_device_alloc_needs_fake_gpus() -> None:
    with pytest.raises(RuntimeError, match="fake_gpus"):
        device_alloc(1, device=0)
