"""The GPU benchmark's measurements in this process: NVML queries, pool freeing, the
guard's runners and leak check, and the CUDA context's footprint (in a fresh process).

Each takes ``(fake, quick)`` and returns its figures; one failing does not stop the
others (:mod:`benchmarks.gpu.costs` records its error).
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import json
import statistics
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from benchmarks.gpu.device import Device, GiB, MiB, no_event, per_call_us, stamp

ROOT = Path(__file__).resolve().parents[2]


def bench_nvml_query(fake: bool, quick: bool) -> dict:
    dev = Device(fake)
    dev.context()
    m = dev.monitor
    reading = m.process_memory(0)
    n = 200 if quick else 1000
    return {
        "process_memory": per_call_us(lambda: m.process_memory(0), n),
        "used": per_call_us(lambda: m.used(0), n),
        "reading": dataclasses.asdict(reading),
    }


def bench_free_all(fake: bool, quick: bool) -> dict:
    dev = Device(fake)
    dev.context()
    dev.free_all()
    out: dict[str, Any] = {}
    reps = 3 if quick else 7
    for label, count, size in (("1x1GiB", 1, GiB), ("256x4MiB", 256, 4 * MiB)):
        times, released, drops = [], [], []
        for _ in range(reps):
            blocks = [dev.alloc(size) for _ in range(count)]
            dev.sync()
            del blocks
            gc.collect()
            before = dev.process_bytes()
            us, freed = stamp(dev.free_all)
            times.append(us)
            released.append(freed)
            drops.append(before - dev.process_bytes())
        out[label] = {
            "median_us": round(statistics.median(times), 1),
            "min_us": round(min(times), 1),
            "released_bytes": int(statistics.median(released)),
            "nvml_drop_bytes": int(statistics.median(drops)),
            "reps": reps,
        }
    out["empty"] = per_call_us(dev.free_all, 200 if quick else 1000)
    return out


def bench_guard_runner(fake: bool, quick: bool) -> dict:
    from dask._task_spec import Task

    from accelsched.internals import wrap_task
    from accelsched.worker.guard_plugin import Binder, PoolFreer, Watch

    dev = Device(fake)
    dev.context()
    n = 2000 if quick else 10000

    def tiny() -> int:
        return 1

    spec = Task("tiny-0", tiny)
    out: dict[str, Any] = {"bare_task": per_call_us(lambda: spec({}), n)}
    visible = dev.monitor.devices()

    def binder(every: int) -> Binder:
        pools = PoolFreer(every=every, above=0.0, monitor=dev.monitor)
        b = Binder(oom_exceptions=(), pools=pools, emit=no_event)
        b.set_devices([d.index for d in visible])
        return b

    for label, every in (("gpu_runner_free_every_task", 1), ("gpu_runner_no_freeing", 0)):
        run = binder(every).gpu_runner("tiny-0", 1)
        out[label] = per_call_us(functools.partial(run, spec, {}), n)
    watch = Watch(monitor=dev.monitor, visible=visible, fail=False, emit=no_event)
    watch_run = watch.runner("tiny-0")
    out["watch_runner_cpu_task"] = per_call_us(lambda: watch_run(spec, {}), max(200, n // 10))
    runner = binder(0).gpu_runner("tiny-0", 1)
    out["wrap_task"] = per_call_us(lambda: wrap_task(spec, runner), n)
    for label in ("gpu_runner_free_every_task", "gpu_runner_no_freeing", "watch_runner_cpu_task"):
        out[label]["overhead_us"] = round(
            out[label]["median_us"] - out["bare_task"]["median_us"], 3
        )
    return out


def bench_guard_check(fake: bool, quick: bool) -> dict:
    from accelsched.config import Threshold
    from accelsched.policy.leak import DeviceHealth, LeakDecisions
    from accelsched.worker.guard_plugin import Binder, PoolFreer
    from accelsched.worker.leak_check import LeakCheck, Ledger, WorkerActor

    dev = Device(fake)
    dev.context()
    owned = dev.monitor.devices()
    pools = PoolFreer(every=0, above=0.0, monitor=dev.monitor)
    binder = Binder(oom_exceptions=(), pools=pools, emit=no_event)
    binder.set_devices([d.index for d in owned])
    binder.used.update(d.index for d in owned)
    ledger = Ledger(dev.monitor)
    # what the check reads of the worker's inventory
    inventory = SimpleNamespace(
        monitor=dev.monitor, owned=owned, granted=owned, health=DeviceHealth()
    )
    check = LeakCheck(
        inventory=inventory,  # type: ignore[arg-type]
        leases=binder.leases,
        used=binder.used,
        ledger=ledger,
        actor=WorkerActor(
            inventory=None,  # type: ignore[arg-type]  # no proposal here reaches it
            set_devices=binder.set_devices,
            emit=no_event,
            spawn=lambda fn, *args: None,
        ),
        decisions=LeakDecisions(2, restart_on_leak=False),
        threshold=Threshold(nbytes=64 * 2**30),
    )
    assert check.check(), "the check looked at no device"
    return {"check_one_device": per_call_us(check.check, 200 if quick else 1000)}


CONTEXT_PROBE = r"""
import json, sys, time
from accelsched.devices import NVMLMonitor
fake = sys.argv[1] == "fake"
m = NVMLMonitor()
m.devices()
out = {}
def mark(label, t0):
    r = m.process_memory(0)
    out[label] = {"bytes": r.nbytes, "exact": r.exact, "has_context": r.has_context,
                  "seconds": round(time.perf_counter() - t0, 4)}
mark("start", time.perf_counter())
if fake:
    from accelsched.testing import create_context, device_alloc
    t0 = time.perf_counter(); create_context(device=0); mark("context", t0)
    t0 = time.perf_counter(); keep = device_alloc(1, device=0); mark("first_alloc", t0)
else:
    import cupy as cp
    t0 = time.perf_counter(); cp.cuda.Device(0).use(); cp.cuda.Device(0).synchronize()
    mark("context", t0)
    t0 = time.perf_counter(); keep = cp.empty(1, dtype=cp.uint8); mark("first_alloc", t0)
    t0 = time.perf_counter(); int(cp.arange(1024).sum()); mark("first_kernel", t0)
    t0 = time.perf_counter(); a = cp.ones((256, 256), dtype=cp.float32); float((a @ a)[0, 0])
    mark("first_cublas", t0)
print(json.dumps(out))
"""


def bench_context_baseline(fake: bool, quick: bool) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", CONTEXT_PROBE, "fake" if fake else "real"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if out.returncode != 0:
        raise RuntimeError(f"context probe failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])
