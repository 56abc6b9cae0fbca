"""Real-GPU validation: the same guarantees as the fake-GPU tests, on an NVIDIA device.

Run with ``python -m pytest -m gpu``. Every test here is skipped unless a real NVIDIA
driver answers (``nvidia-smi`` lists a GPU) and no fake GPUs are active; CuPy-dependent
tests also skip without CuPy. On the GPU machine ``benchmarks/gpu/validate.sh`` runs
them (see ``benchmarks/gpu/README.md``).

Nothing here loads NVML or CUDA in the pytest process itself: the probes run in
subprocesses and the tasks in nanny workers, so fake-GPU tests later in the same session
still get the fake library (a process cannot swap a loaded ``libnvidia-ml.so.1``).
Figures worth keeping (memory sizes, leak estimates) go to the junit XML as properties.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
from typing import Any

import dask
import pytest
from distributed import Nanny, wait
from distributed.utils_test import gen_cluster

import accelsched
from tests.utils import (
    CONFIRMED,
    FAST,
    GiB,
    MiB,
    computed_once,
    cvd,
    events,
    gpus,
    guard_checks,
    last_json,
    run_python,
    verified,
    wait_for,
)

_FAKE_ENV = (
    "ACCELSCHED_FAKE_NVML_DIR",
    "ACCELSCHED_FAKE_NVML_STANDIN",
    "ACCELSCHED_NVML_BACKEND",
)
_CHECKED = "ACCELSCHED_TEST_GPU_MISSING"  # the probe's answer, inherited by workers


def real_env() -> dict[str, str]:
    """``os.environ`` without anything that points NVML at the fake library."""
    env = {k: v for k, v in os.environ.items() if k not in _FAKE_ENV}
    paths = [p for p in env.get("LD_LIBRARY_PATH", "").split(":") if p and "fakenvml-" not in p]
    if paths:
        env["LD_LIBRARY_PATH"] = ":".join(paths)
    else:
        env.pop("LD_LIBRARY_PATH", None)
    return env


def nvidia_smi(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["nvidia-smi", *args], env=real_env(), capture_output=True, text=True, timeout=timeout
    )


def _probe() -> str | None:
    """Why there is no real NVIDIA GPU here (None: there is one)."""
    fake = [k for k in _FAKE_ENV if os.environ.get(k)]
    if fake:
        return f"fake GPUs are active ({', '.join(fake)} set): these tests need a real GPU"
    if shutil.which("nvidia-smi") is None:
        return "no real NVIDIA GPU: nvidia-smi is not on PATH (no driver installed)"
    try:
        out = nvidia_smi("--query-gpu=uuid", "--format=csv,noheader", timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"no real NVIDIA GPU: nvidia-smi failed ({exc!r})"
    if out.returncode != 0 or "GPU-" not in out.stdout:
        first = (out.stderr or out.stdout).strip().splitlines()[:1]
        return f"no real NVIDIA GPU: nvidia-smi exited {out.returncode} ({' '.join(first)})"
    return None


def gpu_missing() -> str | None:
    """The probe, run once per session (workers importing this module reuse its answer)."""
    cached = os.environ.get(_CHECKED)
    if cached is None:
        cached = _probe() or ""
        os.environ[_CHECKED] = cached
    return cached or None


_MISSING = gpu_missing()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(_MISSING is not None, reason=_MISSING or ""),
]


@pytest.fixture(autouse=True)
def _no_nvml_in_this_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """An in-process scheduler must not load the real NVML into the pytest process."""
    from distributed.diagnostics import nvml

    monkeypatch.setattr(nvml, "device_get_count", lambda: 0)


def smi_gpus() -> list[dict[str, Any]]:
    out = nvidia_smi("--query-gpu=uuid,name,memory.total", "--format=csv,noheader,nounits")
    assert out.returncode == 0, out.stderr
    rows = []
    for line in out.stdout.strip().splitlines():
        uuid, name, total = (part.strip() for part in line.split(","))
        rows.append({"uuid": uuid, "name": name, "memory_mib": int(float(total))})
    return rows


# --- NVML inventory, pools, fake vs real shapes (subprocesses) ---------------------------

INVENTORY = r"""
import json
from accelsched.devices import NVMLMonitor
m = NVMLMonitor(env={})
devices = m.devices()
last = devices[-1] if devices else None
by_uuid = NVMLMonitor(env={"CUDA_VISIBLE_DEVICES": last.uuid}).devices() if last else []
by_index = NVMLMonitor(env={"CUDA_VISIBLE_DEVICES": "0"}).devices()
row = lambda d: {**d.as_dict(), "nvml_index": d.nvml_index}
print(json.dumps({"reason": m.reason, "all": [row(d) for d in devices],
                  "by_uuid": [row(d) for d in by_uuid], "by_index": [row(d) for d in by_index]}))
"""


def test_nvml_inventory_matches_nvidia_smi(record_property) -> None:
    smi = smi_gpus()
    ours = last_json(run_python(INVENTORY, env=real_env(), timeout=90))
    record_property("nvidia_smi", json.dumps(smi))
    record_property("nvml_monitor", json.dumps(ours))
    assert ours["reason"] is None
    assert [d["uuid"] for d in ours["all"]] == [g["uuid"] for g in smi]
    assert [d["name"] for d in ours["all"]] == [g["name"] for g in smi]
    assert [d["index"] for d in ours["all"]] == list(range(len(smi)))
    for d, g in zip(ours["all"], smi, strict=True):
        # NVML's total in bytes against nvidia-smi's MiB (which may leave reserved memory out)
        assert abs(d["memory"] / MiB - g["memory_mib"]) <= 0.01 * g["memory_mib"], (d, g)
    assert [d["uuid"] for d in ours["by_uuid"]] == [smi[-1]["uuid"]]
    assert ours["by_uuid"][0]["index"] == 0 and ours["by_uuid"][0]["nvml_index"] == len(smi) - 1
    assert [d["uuid"] for d in ours["by_index"]] == [smi[0]["uuid"]]


POOL_FREEING = r"""
import dataclasses, json, time
import cupy as cp
from accelsched.devices import NVMLMonitor
from accelsched.devices import CupyPool
m = NVMLMonitor(env={"CUDA_VISIBLE_DEVICES": "0"})
m.devices()
pool = CupyPool()
reading = lambda: dataclasses.asdict(m.process_memory(0))
stats = lambda: dataclasses.asdict(pool.stats(0))
out = {"before": reading()}
cp.cuda.Device(0).use()
x = cp.empty(1 << 30, dtype=cp.uint8)
cp.cuda.Device(0).synchronize()
out["held"], out["stats_held"] = reading(), stats()
del x
out["cached"], out["stats_cached"] = reading(), stats()
out["released"] = pool.free_all()
deadline = time.monotonic() + 2
while reading()["nbytes"] > out["cached"]["nbytes"] - (1 << 29) and time.monotonic() < deadline:
    time.sleep(0.01)
out["after"], out["stats_after"] = reading(), stats()
out["rmm"] = pool.uses_rmm()
print(json.dumps(out))
"""


def test_cupy_pool_freeing_returns_memory_to_the_driver(record_property) -> None:
    pytest.importorskip("cupy")
    r = last_json(run_python(POOL_FREEING, env=real_env(), timeout=90))
    record_property("pool_freeing", json.dumps(r))
    held, cached, after = r["held"], r["cached"], r["after"]
    assert r["before"]["has_context"] is not True  # no context before the first allocation
    assert held["has_context"] is True
    assert held["exact"] is True, "NVML gave no per-process figure for this pid"
    assert not r["rmm"]
    assert r["stats_held"]["held"] >= GiB  # the pool holds the array
    # deleting the array only moves it to the pool's cache: NVML still counts it
    assert cached["nbytes"] >= held["nbytes"] - 4 * MiB
    assert r["stats_cached"]["cached"] >= GiB
    # free_all() gives it back to the driver, and NVML sees this process drop by ~1 GiB
    assert r["released"] >= GiB
    assert cached["nbytes"] - after["nbytes"] >= GiB - 4 * MiB, r
    assert r["stats_after"]["held"] == 0


SHAPES = r"""
import dataclasses, json, os, sys
mode = sys.argv[1]
if mode == "real":
    import cupy
    buf = cupy.empty(1 << 20, dtype=cupy.uint8)
else:
    if mode == "standin":
        os.environ["CC"] = "/nonexistent/cc"  # no compiler: fake_gpus uses the stand-in
    import warnings
    warnings.simplefilter("ignore")
    from accelsched.testing import device_alloc, fake_gpus
    session = fake_gpus(count=1, memory="16GiB")
    gpus = session.__enter__()
    assert gpus.standin == (mode == "standin"), (mode, gpus)
    buf = device_alloc(1 << 20, device=0)
from accelsched.devices import cuda, load_backend
from accelsched.devices import NVMLMonitor
nvml = load_backend()
# the backend's CUDA: CuPy on the real GPU, numpy (nothing made current) on the fakes
assert cuda().array_module().__name__ == ("cupy" if mode == "real" else "numpy"), mode
nvml.nvmlInit()
h = nvml.nvmlDeviceGetHandleByIndex(0)

def shape(obj):
    names = [f[0] for f in getattr(obj, "_fields_", ())] or sorted(vars(obj))
    return {n: type(getattr(obj, n)).__name__ for n in names}

procs = nvml.nvmlDeviceGetComputeRunningProcesses(h)
mine = [p for p in procs if p.pid == os.getpid()]
m = NVMLMonitor(env={})
reading = m.process_memory(0)
out = {
    "module": nvml.__name__,
    "count": type(nvml.nvmlDeviceGetCount()).__name__,
    "uuid": type(nvml.nvmlDeviceGetUUID(h)).__name__,
    "name": type(nvml.nvmlDeviceGetName(h)).__name__,
    "memory_info": shape(nvml.nvmlDeviceGetMemoryInfo(h)),
    "process_list": type(procs).__name__,
    "process": shape(mine[0]) if mine else None,
    "instance_ids": [mine[0].gpuInstanceId, mine[0].computeInstanceId] if mine else None,
    "device_info": {k: type(v).__name__ for k, v in dataclasses.asdict(m.devices()[0]).items()},
    "memory_reading": {k: type(v).__name__ for k, v in dataclasses.asdict(reading).items()},
    "reading": [reading.exact, reading.has_context],
    "uuid_prefix": nvml.nvmlDeviceGetUUID(h)[:4],
}
try:
    out["memory_info_v2"] = shape(nvml.nvmlDeviceGetMemoryInfo(h, version=nvml.nvmlMemory_v2))
except Exception as exc:
    out["memory_info_v2"] = type(exc).__name__
print(json.dumps(out))
"""

#: What must be the same between the real NVML and the fakes (the calls accelsched makes).
SAME = (
    "count",
    "uuid",
    "name",
    "memory_info",
    "process_list",
    "process",
    "device_info",
    "memory_reading",
    "reading",
    "uuid_prefix",
)


@pytest.mark.parametrize("fake", ["library", "standin"])
def test_fake_nvml_answers_in_the_shape_of_the_real_one(
    fake: str, record_property, tmp_path
) -> None:
    pytest.importorskip("cupy")
    if fake == "library" and not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler here to build the fake libnvidia-ml.so.1")
    real = last_json(run_python(SHAPES, "real", env=real_env(), timeout=90))
    env = real_env()
    env["ACCELSCHED_CACHE_DIR"] = str(tmp_path / "cache")  # a fresh build of the fake library
    env.pop(_CHECKED, None)
    faked = last_json(run_python(SHAPES, fake, env=env, timeout=90))
    record_property("real", json.dumps(real))
    record_property(fake, json.dumps(faked))
    assert real["module"] == "pynvml"
    assert real["process"] is not None, "NVML does not list this process (foreign pid namespace?)"
    assert {k: faked[k] for k in SAME} == {k: real[k] for k in SAME}
    # not a call accelsched makes, but the fakes claim to answer it: report, do not fail
    if faked["memory_info_v2"] != real["memory_info_v2"]:
        record_property(
            "memory_info_v2_differs", json.dumps([real["memory_info_v2"], faked["memory_info_v2"]])
        )
    if faked["instance_ids"] != real["instance_ids"]:
        record_property(
            "instance_ids_differ", json.dumps([real["instance_ids"], faked["instance_ids"]])
        )


# --- cluster tests: one GPU worker and one CPU-only peer (nanny processes) -------------


GPU_AND_CPU: list[tuple[str, int] | tuple[str, int, dict]] = [
    ("127.0.0.1", 1, cvd("0", resources={"GPU": 1})),
    ("127.0.0.1", 1, cvd("")),
]

#: Device memory this module's tasks deliberately keep (in the worker process).
KEPT: list[Any] = []


def square_on_gpu(i: int) -> int:
    import cupy

    return int((cupy.full((4,), i, dtype=cupy.int64) ** 2)[0])


def leak_on_gpu(nbytes: int) -> int:
    import cupy

    KEPT.append(cupy.zeros(nbytes, dtype=cupy.uint8))
    return len(KEPT)


def big_result(nbytes: int) -> Any:
    import cupy

    return cupy.zeros(nbytes, dtype=cupy.uint8)  # held as a result: live, not leaked


def cached_temporaries(nbytes: int) -> int:
    import cupy

    for _ in range(3):
        cupy.zeros(nbytes, dtype=cupy.uint8)  # freed at once: stays in CuPy's pool
    return nbytes


def inside_gpu_task() -> dict[str, Any]:
    import cupy

    xp = accelsched.array_module()
    a = xp.arange(10)
    return {
        "module": xp.__name__,
        "device": accelsched.current_device(),
        "cuda_device": cupy.cuda.runtime.getDevice(),
        "array_device": int(a.device.id),
        "is_cupy": isinstance(a, cupy.ndarray),
        "sum": int(a.sum()),
    }


def outside_gpu_task() -> tuple[str, int | None]:
    return accelsched.array_module().__name__, accelsched.current_device()


def gpu_form(n: int) -> tuple[str, int, int | None]:
    xp = accelsched.array_module()
    return xp.__name__, int(xp.arange(n).sum()), accelsched.current_device()


def cpu_form(n: int) -> tuple[str, int, int | None]:
    import numpy

    return "cpu:" + numpy.__name__, int(numpy.arange(n).sum()), accelsched.current_device()


def too_big(n: int) -> tuple[str, int, int | None]:
    import cupy

    cupy.empty(1 << 40, dtype=cupy.uint8)  # 1 TiB: more than any GPU has
    return "gpu", n, accelsched.current_device()


@gen_cluster(client=True, Worker=Nanny, nthreads=GPU_AND_CPU, timeout=90)
async def test_binding_and_array_module_on_a_real_gpu(c, s, gpu, cpu):
    pytest.importorskip("cupy")
    await accelsched.register(c)
    await verified(s, gpu, timeout=30)
    (v,) = events(s, "gpu-verified")
    assert v["worker"] == gpu.worker_address
    assert [d["uuid"] for d in v["devices"]] == [smi_gpus()[0]["uuid"]]
    assert gpus(s, cpu.worker_address) == 0
    with dask.annotate(resources={"GPU": 1}):
        inside = await c.submit(inside_gpu_task, key="inside")
    assert inside == {
        "module": "cupy",
        "device": 0,
        "cuda_device": 0,
        "array_device": 0,
        "is_cupy": True,
        "sum": 45,
    }
    # a plain task on the same worker holds no device and sees numpy
    outside = await c.submit(outside_gpu_task, key="outside", workers=[gpu.worker_address])
    assert tuple(outside) == ("numpy", None)
    assert not events(s, "unrequested-gpu-use")


@gen_cluster(client=True, Worker=Nanny, nthreads=GPU_AND_CPU, timeout=90)
async def test_dual_on_both_paths_and_oom_retry(c, s, gpu, cpu):
    pytest.importorskip("cupy")
    await accelsched.register(c)
    await verified(s, gpu, timeout=30)
    job = accelsched.dual(gpu_form, cpu_form)
    with dask.annotate(resources={"GPU": 1}):
        on_gpu = c.submit(job, 10, key="dual-gpu")
    on_cpu = c.submit(job, 10, key="dual-cpu", workers=[cpu.worker_address])
    assert tuple(await on_gpu) == ("cupy", 45, 0)
    assert tuple(await on_cpu) == ("cpu:numpy", 45, None)
    # CuPy's real OutOfMemoryError makes the task retry in its CPU form
    with dask.annotate(resources={"GPU": 1}):
        oom = await c.submit(accelsched.dual(too_big, cpu_form), 10, key="dual-oom")
    assert tuple(oom) == ("cpu:numpy", 45, 0)  # the CPU form ran under the GPU lease
    (e,) = events(s, "fallback")
    assert e["key"] == "dual-oom" and e["reason"] == "oom" and "OutOfMemoryError" in e["error"]


@gen_cluster(client=True, Worker=Nanny, nthreads=GPU_AND_CPU, timeout=120)
async def test_real_leak_restarts_the_worker_and_loses_nothing(c, s, gpu, cpu):
    pytest.importorskip("cupy")
    await accelsched.register(c, **FAST)
    await verified(s, gpu, timeout=30)
    target = gpu.worker_address
    with dask.annotate(resources={"GPU": 1}):
        before = [c.submit(square_on_gpu, i, key=f"square-{i}") for i in range(4)]
    assert await c.gather(before) == [0, 1, 4, 9]
    assert all(s.tasks[f"square-{i}"].who_has == {s.workers[target]} for i in range(4))

    with dask.annotate(resources={"GPU": 1}):
        assert await c.submit(leak_on_gpu, 512 * MiB, key="leaky-1") == 1
    await wait_for(lambda: events(s, "restart"), timeout=60)
    (leak,) = events(s, "leak")
    assert leak["worker"] == target and leak["device"] == 0
    assert leak["nbytes"] > 256 * MiB and leak["checks"] >= 2
    assert any(p.startswith("leaky") for p in leak["prefixes"])
    (restart,) = events(s, "restart")
    assert restart["worker"] == target and restart["reason"] == "leak" and restart["moved"] >= 4
    # the GPU worker comes back verified under a new address; its data lives on the peer
    await wait_for(
        lambda: (
            len(s.workers) == 2
            and target not in s.workers
            and any(gpus(s, w) == 1 for w in s.workers)
        ),
        timeout=60,
    )
    assert len(events(s, "gpu-verified")) == 2
    assert await c.gather(before) == [0, 1, 4, 9]
    assert all(computed_once(s, f"square-{i}") for i in range(4))
    assert await c.submit(lambda: 1, key="after") == 1
    await guard_checks(c, s, [w for w in s.workers if gpus(s, w) == 1], CONFIRMED)
    assert len(events(s, "leak")) == 1 and len(events(s, "restart")) == 1


@gen_cluster(client=True, Worker=Nanny, nthreads=GPU_AND_CPU, timeout=90)
async def test_no_false_positive_with_large_cupy_results_held(c, s, gpu, cpu):
    pytest.importorskip("cupy")
    await accelsched.register(c, free_pools_every=0, **FAST)
    await verified(s, gpu, timeout=30)
    with dask.annotate(resources={"GPU": 1}):
        held = c.map(big_result, [512 * MiB] * 4, key=[f"big-{i}" for i in range(4)])
        await wait(held)  # 2 GiB of device results stay on the worker, never gathered
        await c.gather(c.map(cached_temporaries, [512 * MiB] * 2, pure=False))
    await guard_checks(c, s, [gpu.worker_address], CONFIRMED)

    def verdicts(dask_worker) -> list[tuple[int, int]]:  # type: ignore[no-untyped-def]
        guard = dask_worker.plugins["accelsched-guard"]
        return [(v.estimate, v.threshold) for v in guard.leaks.last_verdicts]

    seen = (await c.run(verdicts, workers=[gpu.worker_address]))[gpu.worker_address]
    assert not events(s, "leak"), (events(s, "leak"), seen)
    assert seen and all(est < thr for est, thr in seen), seen
    # results released: their memory goes to the pool's cache, still not a leak
    keys = [f.key for f in held]
    del held

    def still_held(keys: list[str], dask_worker) -> int:  # type: ignore[no-untyped-def]
        return sum(1 for k in keys if k in dask_worker.data)

    while await c.run(still_held, keys, workers=[gpu.worker_address]) != {gpu.worker_address: 0}:
        await asyncio.sleep(0.02)
    await guard_checks(c, s, [gpu.worker_address], CONFIRMED)
    assert not events(s, "leak")
    assert not events(s, "restart")
