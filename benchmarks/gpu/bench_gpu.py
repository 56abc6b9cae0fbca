"""accelsched's costs on a real GPU: guard overhead, NVML queries, pool freeing, leaks.

    python benchmarks/gpu/bench_gpu.py [--out DIR]          # on a machine with a GPU
    python benchmarks/gpu/bench_gpu.py --fake [--out DIR]   # dry run on fake_gpus (CPU)

Writes ``bench.json`` (every figure, the environment, errors) and ``bench.txt`` (a short
table, also printed last). With ``--fake`` every figure comes from
``accelsched.testing.fake_gpus`` on the CPU and is labelled as such: those numbers say
the script works, not what a GPU costs.

Measured:

- ``guard_runner``: µs the GuardPlugin adds to one task, timed on its runner wrappers
  directly (device lease + CUDA device switch + pool free after the task; the watcher a
  CPU task gets on a GPU worker), and the wrapping itself.
- ``cluster_tasks``: µs per tiny GPU task end to end, without then with the plugins
  (scheduler round trips dominate; the difference is the guard's share, noisy).
- ``nvml_query``: µs per ``NVMLMonitor.process_memory`` and ``used``.
- ``guard_check``: µs per periodic leak check (``LeakCheck.check``) over one device.
- ``free_all_blocks``: µs per ``CupyPool.free_all()`` with ~1 GiB cached (one block,
  many blocks) and with nothing cached, and what NVML saw go back.
- ``context_baseline``: this process's device memory after CUDA context creation, the
  first allocation, the first kernel and the first cuBLAS call (a fresh subprocess).
- ``leak_and_restart``: a 512 MiB leak on a worker with ``check_interval=100ms``,
  threshold 256 MiB, 2 confirmations: seconds and checks from the leaking task's end to
  the ``leak`` event, and seconds from there (the restart request) to the worker back
  with its GPUs verified.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

MiB = 2**20
GiB = 2**30
ROOT = Path(__file__).resolve().parents[2]
FAKE_LABEL = "FAKE GPUs (accelsched.testing.fake_gpus on the CPU): NOT GPU FIGURES"


# --- timing helpers -------------------------------------------------------------------


def per_call_us(
    fn: Callable[[], Any], n: int, rounds: int = 5, warmup: int = 20, budget_s: float = 0.25
) -> dict:
    """Median and min over ``rounds`` of the mean µs per call of ``fn``.

    A round is ``n`` calls, or fewer when that would take longer than ``budget_s``.
    """
    t0 = time.perf_counter()
    for _ in range(warmup):
        fn()
    each = (time.perf_counter() - t0) / max(warmup, 1)
    if each > 0:
        n = max(20, min(n, int(budget_s / each)))
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        samples.append((time.perf_counter() - t0) / n * 1e6)
    return {
        "median_us": round(statistics.median(samples), 3),
        "min_us": round(min(samples), 3),
        "calls": n * rounds,
    }


def stamp(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    value = fn()
    return (time.perf_counter() - t0) * 1e6, value


# --- environment ----------------------------------------------------------------------


def environment(fake: bool) -> dict:
    from importlib.metadata import PackageNotFoundError, version

    env: dict[str, Any] = {
        "mode": "fake" if fake else "gpu",
        "label": FAKE_LABEL if fake else "real GPU",
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    for name in (
        "accelsched",
        "dask",
        "distributed",
        "nvidia-ml-py",
        "cupy-cuda13x",
        "cupy-cuda12x",
        "numpy",
    ):
        with contextlib.suppress(PackageNotFoundError):
            env[name] = version(name)
    from accelsched.devices.nvml import NVMLMonitor

    m = NVMLMonitor()
    env["devices"] = [d.as_dict() for d in m.devices()]
    if not fake and m.available:
        nvml = m._nvml
        with contextlib.suppress(Exception):
            env["driver"] = _text(nvml.nvmlSystemGetDriverVersion())
        with contextlib.suppress(Exception):
            env["cuda_driver"] = nvml.nvmlSystemGetCudaDriverVersion()
    return env


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


# --- device helpers: CuPy on a GPU, the simulated pool on fake GPUs ----------------------


class Device:
    """Allocation, context and freeing on device 0, real or simulated."""

    def __init__(self, fake: bool) -> None:
        self.fake = fake
        from accelsched.devices.nvml import NVMLMonitor

        self.monitor = NVMLMonitor()
        if not self.monitor.devices():
            raise RuntimeError(f"no GPU visible: {self.monitor.reason}")
        if not fake:
            import cupy

            self.cp = cupy
            cupy.cuda.Device(0).use()

    def context(self) -> None:
        if self.fake:
            from accelsched.testing import create_context

            create_context(device=0)
        else:
            self.cp.cuda.Device(0).synchronize()

    def alloc(self, nbytes: int) -> Any:
        if self.fake:
            from accelsched.testing import device_alloc

            return device_alloc(nbytes, device=0)
        return self.cp.empty(nbytes, dtype=self.cp.uint8)

    def sync(self) -> None:
        if not self.fake:
            self.cp.cuda.Device(0).synchronize()

    def pools(self) -> list:
        from accelsched.devices.pool import active_pools

        return active_pools()

    def free_all(self) -> int:
        return sum(p.free_all() for p in self.pools())

    def process_bytes(self) -> int:
        return self.monitor.process_memory(0).nbytes


# --- the measurements ----------------------------------------------------------------


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
    from accelsched.worker.binder import Binder
    from accelsched.worker.pool_freer import PoolFreer
    from accelsched.worker.watch import Watch

    dev = Device(fake)
    dev.context()
    n = 2000 if quick else 10000

    def tiny() -> int:
        return 1

    spec = Task("tiny-0", tiny)
    out: dict[str, Any] = {"bare_task": per_call_us(lambda: spec({}), n)}
    visible = dev.monitor.devices()

    def binder(every: int) -> Binder:
        pools = PoolFreer(every=every, above=0.0, monitor=dev.monitor, simulated=fake)
        b = Binder(simulated=fake, oom_exceptions=(), pools=pools, emit=_no_event)
        b.set_devices([d.index for d in visible])
        return b

    for label, every in (("gpu_runner_free_every_task", 1), ("gpu_runner_no_freeing", 0)):
        run = binder(every).gpu_runner("tiny-0", 1)
        out[label] = per_call_us(functools.partial(run, spec, {}), n)
    watch = Watch(monitor=dev.monitor, visible=visible, fail=False, emit=_no_event)
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
    from accelsched.policy.health import DeviceHealth
    from accelsched.worker.acting import WorkerActor
    from accelsched.worker.binder import Binder
    from accelsched.worker.inventory import Inventory
    from accelsched.worker.leak_check import LeakCheck, LeakOptions
    from accelsched.worker.ledger import Ledger
    from accelsched.worker.pool_freer import PoolFreer
    from accelsched.worker.readings import DeviceReadings
    from accelsched.worker.results import LiveResults

    dev = Device(fake)
    dev.context()
    owned = dev.monitor.devices()
    pools = PoolFreer(every=0, above=0.0, monitor=dev.monitor, simulated=fake)
    binder = Binder(simulated=fake, oom_exceptions=(), pools=pools, emit=_no_event)
    binder.set_devices([d.index for d in owned])
    binder.used.update(d.index for d in owned)
    check = LeakCheck(
        readings=DeviceReadings(
            monitor=dev.monitor,
            owned=owned,
            granted=lambda: owned,
            health=DeviceHealth(),
            recover=True,
        ),
        live=LiveResults(ledger=Ledger(dev.monitor), owned=owned, leases=binder.leases),
        binder=binder,
        options=LeakOptions(Threshold(nbytes=64 * 2**30), confirmations=2, restart_on_leak=False),
        actor=WorkerActor(
            inventory=Inventory(advertise_undeclared=False),
            set_devices=binder.set_devices,
            emit=_no_event,
            spawn=lambda fn, *args: None,
        ),
    )
    assert check.check(), "the check looked at no device"
    return {"check_one_device": per_call_us(check.check, 200 if quick else 1000)}


def _no_event(action: str, **figures: Any) -> None:
    """Stands in for the guard's event sender outside a worker."""


CONTEXT_PROBE = r"""
import json, sys, time
from accelsched.devices.nvml import NVMLMonitor
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


# --- cluster measurements ------------------------------------------------------------


def tiny_task(i: int) -> int:
    return i


def gpu_tiny_task(i: int) -> int:
    import accelsched

    return i if accelsched.current_device() is not None else -1


def leak_task(nbytes: int, fake: bool) -> float:
    """Keep ``nbytes`` of device memory referenced forever; return the wall time it ended."""
    holder = sys.modules.setdefault("_accelsched_bench_leak", type(sys)("_accelsched_bench_leak"))
    kept = holder.__dict__.setdefault("kept", [])
    if fake:
        from accelsched.testing import device_alloc

        kept.append(device_alloc(nbytes))
    else:
        import cupy

        kept.append(cupy.zeros(nbytes, dtype=cupy.uint8))
        cupy.cuda.Device().synchronize()
    return time.time()


async def _events(client: Any, action: str) -> list[tuple[float, dict]]:
    found = await client.get_events("accelsched")
    return [(t, m) for t, m in found if m.get("action") == action]


async def _until(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = await predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)


async def _timed_batch(client: Any, fn: Callable, n: int, tag: str) -> float:
    import dask

    with dask.annotate(resources={"GPU": 1}):
        futures = client.map(fn, range(n), key=[f"{tag}-{i}" for i in range(n)])
    t0 = time.perf_counter()
    await client.gather(futures)
    elapsed = time.perf_counter() - t0
    del futures
    return elapsed / n * 1e6


async def cluster_bench(fake: bool, quick: bool, out: dict[str, Any]) -> None:
    """Fills ``out`` as it goes, so a later phase failing keeps the earlier figures."""
    from distributed import Client, Nanny, Scheduler

    import accelsched

    n = 100 if quick else 300
    async with (
        Scheduler(dashboard=False, port=0) as s,
        Nanny(
            s.address, nthreads=1, env={"CUDA_VISIBLE_DEVICES": "0"}, resources={"GPU": 1}
        ) as gpu,
        Nanny(s.address, nthreads=1, env={"CUDA_VISIBLE_DEVICES": ""}) as _cpu,
        Client(s.address, asynchronous=True) as c,
    ):
        # without the plugins: distributed alone places on the declared resource
        await _timed_batch(c, tiny_task, n, "warm")
        without = [await _timed_batch(c, tiny_task, n, f"bare{r}") for r in range(3)]
        await accelsched.register(  # type: ignore[misc]
            c, check_interval="100ms", leak_threshold="256MiB", leak_confirmations=2
        )

        async def verified() -> list:
            return await _events(c, "gpu-verified")

        await _until(verified, 30, "gpu-verified")
        await _timed_batch(c, gpu_tiny_task, n, "gwarm")  # context creation happens here
        with_ = [await _timed_batch(c, gpu_tiny_task, n, f"guard{r}") for r in range(3)]
        out["cluster_tasks"] = {
            "tasks_per_batch": n,
            "without_plugins_us": round(statistics.median(without), 1),
            "with_plugins_us": round(statistics.median(with_), 1),
            "difference_us": round(statistics.median(with_) - statistics.median(without), 1),
            "all_without_us": [round(x, 1) for x in without],
            "all_with_us": [round(x, 1) for x in with_],
        }

        # a leak: detection latency, then the lossless restart and the worker's return
        import dask

        kept = c.submit(tiny_task, 7, key="kept-result", workers=[gpu.worker_address])
        await kept
        old = gpu.worker_address
        with dask.annotate(resources={"GPU": 1}):
            ended = await c.submit(leak_task, 512 * MiB, fake, key="leaky-bench")

        async def leaked() -> list:
            return await _events(c, "leak")

        (t_leak, leak), *_ = await _until(leaked, 30, "a leak event")
        found = out["leak_and_restart"] = {
            "leak_bytes": 512 * MiB,
            "estimate_bytes": leak.get("nbytes"),
            "check_interval_s": 0.1,
            "confirmations": 2,
            "detection_s": round(t_leak - ended, 3),
            "detection_checks": leak.get("checks"),
        }

        async def back() -> list:
            return [
                (t, m)
                for t, m in await _events(c, "gpu-verified")
                if m.get("worker") != old and t > t_leak
            ]

        (t_back, _), *_ = await _until(back, 60, "the restarted worker verified")
        restarts = await _events(c, "restart")
        t_restart, restart = restarts[0] if restarts else (None, {})
        found.update(
            {
                "restart_event_after_s": None
                if t_restart is None
                else round(t_restart - t_leak, 3),
                "restart_reported_s": restart.get("seconds"),
                "moved_keys": restart.get("moved"),
                "restart_to_ready_s": round(t_back - t_leak, 3),
                "kept_result_survived": (await kept) == 7,
            }
        )


def bench_cluster(fake: bool, quick: bool) -> dict:
    out: dict[str, Any] = {}
    try:
        asyncio.run(asyncio.wait_for(cluster_bench(fake, quick, out), 150))
    except Exception as exc:
        exc.partial = out  # type: ignore[attr-defined]
        raise
    return out


# --- report ---------------------------------------------------------------------------


BENCHES: list[tuple[str, Callable[[bool, bool], dict]]] = [
    ("context_baseline", bench_context_baseline),
    ("nvml_query", bench_nvml_query),
    ("guard_check", bench_guard_check),
    ("free_all_blocks", bench_free_all),
    ("guard_runner", bench_guard_runner),
    ("cluster", bench_cluster),
]


def table(result: dict) -> str:
    m = result["measurements"]
    rows: list[tuple[str, str, str]] = []

    def add(label: str, path: tuple[str, ...], unit: str, scale: float = 1.0) -> None:
        value: Any = m
        for part in path:
            if not isinstance(value, dict) or part not in value:
                rows.append((label, "n/a", unit))
                return
            value = value[part]
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            text = f"{value * scale:,.3f}".rstrip("0").rstrip(".") if scale != 1 else f"{value:,}"
        else:
            text = str(value)
        rows.append((label, text, unit))

    add(
        "guard GPU runner overhead (free every task)",
        ("guard_runner", "gpu_runner_free_every_task", "overhead_us"),
        "us/task",
    )
    add(
        "guard GPU runner overhead (no freeing)",
        ("guard_runner", "gpu_runner_no_freeing", "overhead_us"),
        "us/task",
    )
    add(
        "guard watcher overhead (CPU task, GPU worker)",
        ("guard_runner", "watch_runner_cpu_task", "overhead_us"),
        "us/task",
    )
    add(
        "tiny GPU task end to end, no plugins",
        ("cluster", "cluster_tasks", "without_plugins_us"),
        "us/task",
    )
    add(
        "tiny GPU task end to end, with plugins",
        ("cluster", "cluster_tasks", "with_plugins_us"),
        "us/task",
    )
    add("NVMLMonitor.process_memory", ("nvml_query", "process_memory", "median_us"), "us/call")
    add(
        "GuardPlugin.check (one device)",
        ("guard_check", "check_one_device", "median_us"),
        "us/call",
    )
    add("free_all, 1 GiB cached in 1 block", ("free_all_blocks", "1x1GiB", "median_us"), "us")
    add("free_all, 1 GiB cached in 256 blocks", ("free_all_blocks", "256x4MiB", "median_us"), "us")
    add("free_all, nothing cached", ("free_all_blocks", "empty", "median_us"), "us")
    add(
        "NVML drop after free_all (1 GiB)",
        ("free_all_blocks", "1x1GiB", "nvml_drop_bytes"),
        "MiB",
        1 / MiB,
    )
    add("CUDA context baseline", ("context_baseline", "context", "bytes"), "MiB", 1 / MiB)
    add("after first kernel", ("context_baseline", "first_kernel", "bytes"), "MiB", 1 / MiB)
    add("after first cuBLAS call", ("context_baseline", "first_cublas", "bytes"), "MiB", 1 / MiB)
    add("context creation time", ("context_baseline", "context", "seconds"), "s")
    add("leak detection latency", ("cluster", "leak_and_restart", "detection_s"), "s")
    add("leak detection latency", ("cluster", "leak_and_restart", "detection_checks"), "checks")
    add(
        "restart request to GPUs verified",
        ("cluster", "leak_and_restart", "restart_to_ready_s"),
        "s",
    )
    add(
        "kept result survived the restart",
        ("cluster", "leak_and_restart", "kept_result_survived"),
        "",
    )
    env = result["environment"]
    head = [
        f"accelsched GPU benchmark: {env['label']}",
        "devices: "
        + (
            ", ".join(f"{d['name']} ({d['memory'] / GiB:.1f} GiB)" for d in env.get("devices", []))
            or "none"
        ),
    ]
    width = max(len(r[0]) for r in rows)
    lines = head + [f"{'':-<{width + 30}}"]
    lines += [f"{label:<{width}}  {value:>14}  {unit}" for label, value, unit in rows]
    if result["errors"]:
        lines.append("errors: " + ", ".join(sorted(result["errors"])) + " (see bench.json)")
    if env["mode"] == "fake":
        lines.append(f"*** {FAKE_LABEL} ***")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fake", action="store_true", help="use fake GPUs (CPU dry run)")
    parser.add_argument("--out", default=".", help="folder for bench.json and bench.txt")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--only", nargs="*", default=None, help="run only these benchmarks")
    args = parser.parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    session: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    if args.fake:
        from accelsched.testing import fake_gpus

        session = fake_gpus(count=1, memory="16GiB")
    result: dict[str, Any] = {"measurements": {}, "errors": {}, "seconds": {}}
    with session:
        result["environment"] = environment(args.fake)
        for name, bench in BENCHES:
            if args.only is not None and name not in args.only:
                continue
            t0 = time.perf_counter()
            print(f"bench_gpu: {name} ...", flush=True)
            try:
                figures = bench(args.fake, args.quick)
            except BaseException as exc:  # one failure must not lose the other figures
                if isinstance(exc, KeyboardInterrupt):
                    raise
                result["errors"][name] = "".join(traceback.format_exception(exc))[-4000:]
                if getattr(exc, "partial", None):
                    result["measurements"][name] = exc.partial  # type: ignore[attr-defined]
                print(f"bench_gpu: {name} failed: {exc!r}", flush=True)
            else:
                result["measurements"][name] = figures
            result["seconds"][name] = round(time.perf_counter() - t0, 2)
    (out_dir / "bench.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    text = table(result)
    (out_dir / "bench.txt").write_text(text)
    print(text, end="")
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
