"""accelsched's costs on a real GPU: guard overhead, NVML queries, pool freeing, leaks.

    python -m benchmarks gpu [--quick] [--out DIR]          # on a machine with a GPU
    python -m benchmarks gpu --fake [--quick] [--out DIR]   # dry run on fake_gpus (CPU)

Without a GPU (and without ``--fake``) it refuses before anything runs, saying why
(:func:`unavailable`). Writes ``gpu.json`` (every figure, the devices, errors, and the
provenance every result file has) and ``gpu.txt`` (a short table, also printed last;
:mod:`benchmarks.gpu.table`). With ``--fake`` every figure comes from
``accelsched.testing.fake_gpus`` on the CPU and is labelled as such: those numbers say
the benchmark works, not what a GPU costs. Nothing here imports matplotlib or psutil:
the GPU image has neither.

Measured (:mod:`benchmarks.gpu.probes`, then :mod:`benchmarks.gpu.on_cluster`):

- ``guard_runner``: µs the GuardPlugin adds to one task, timed on its runner wrappers
  directly (device lease + CUDA device switch + pool free after the task; the watcher a
  CPU task gets on a GPU worker), and the wrapping itself.
- ``cluster_tasks``: µs per tiny GPU task end to end on a plain cluster and on one with
  the plugins (their defaults), both on GPU 0, each worker with a CUDA context made first
  (so the guard measures GPU tasks, on a sample of a quiet prefix's runs, as for real GPU
  work), in 7 paired rounds of 300 tasks (5 of 100 with ``--quick``) in alternating
  order: the paired ratio and difference (median, min, max); scheduler round trips
  dominate, the difference is the guard's share. Beside it the GPU worker process's CPU
  per task on each side and their paired ratio: issue 27's target for tiny GPU tasks
  with a context, at most 1.05.
- ``nvml_query``: µs per ``NVMLMonitor.process_memory`` and ``used``.
- ``guard_check``: µs per periodic leak check (``LeakCheck.check``) over one device.
- ``free_all_blocks``: µs per ``CupyPool.free_all()`` with ~1 GiB cached (one block,
  many blocks) and with nothing cached, and what NVML saw go back.
- ``context_baseline``: this process's device memory after CUDA context creation, the
  first allocation, the first kernel and the first cuBLAS call (a fresh subprocess).
- ``leak_and_restart``: the plugins registered again, then a 512 MiB leak on a worker
  with ``check_interval=100ms``,
  threshold 256 MiB, 2 confirmations: seconds and checks from the leaking task's end to
  the ``leak`` event, and seconds from there (the restart request) to the worker back
  with its GPUs verified.
"""

from __future__ import annotations

import contextlib
import os
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.gpu import probes
from benchmarks.gpu.device import environment
from benchmarks.gpu.on_cluster import bench_cluster
from benchmarks.gpu.table import table

#: What points NVML at the simulated GPUs: set, a "real" run would measure them.
FAKE_ENV = (
    "ACCELSCHED_FAKE_NVML_DIR",
    "ACCELSCHED_FAKE_NVML_STANDIN",
    "DASK_ACCELSCHED__NVML_BACKEND",
)

BENCHES: list[tuple[str, Callable[[bool, bool], dict]]] = [
    ("context_baseline", probes.bench_context_baseline),
    ("nvml_query", probes.bench_nvml_query),
    ("guard_check", probes.bench_guard_check),
    ("free_all_blocks", probes.bench_free_all),
    ("guard_runner", probes.bench_guard_runner),
    ("cluster", bench_cluster),
]


def unavailable(fake: bool = False) -> str | None:
    """Why a real-GPU run cannot start here (None: it can). Asked before anything runs:
    without a GPU every measurement would fail one by one (the cluster's after waiting
    30 s for a GPU), leaving a table of n/a that reads like a broken GPU."""
    if fake:
        return None
    active = [k for k in FAKE_ENV if os.environ.get(k)]
    if active:
        return (
            f"fake GPUs are active ({', '.join(active)} set): a real-GPU run would measure "
            "them; unset it, or pass --fake to dry-run on simulated GPUs"
        )
    from accelsched.devices import NVMLMonitor

    monitor = NVMLMonitor()
    if not monitor.devices():
        return (
            f"no real NVIDIA GPU here (NVML: {monitor.reason or 'no device'}); "
            "--fake dry-runs it on simulated GPUs (not GPU figures)"
        )
    return None


def run(quick: bool, out: Path, fake: bool = False) -> dict[str, Any]:
    """Every measurement in turn; one failing keeps the others' figures (and its partial
    ones) and is listed under ``errors``, which makes the command exit 1."""
    out.mkdir(parents=True, exist_ok=True)
    session: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    if fake:
        from accelsched.testing import fake_gpus

        session = fake_gpus(count=1, memory="16GiB")
    result: dict[str, Any] = {"measurements": {}, "errors": {}, "seconds": {}}
    with session:
        result["environment"] = environment(fake)
        for name, bench in BENCHES:
            t0 = time.perf_counter()
            print(f"gpu: {name} ...", flush=True)
            try:
                figures = bench(fake, quick)
            except BaseException as exc:  # one failure must not lose the other figures
                if isinstance(exc, KeyboardInterrupt):
                    raise
                result["errors"][name] = "".join(traceback.format_exception(exc))[-4000:]
                if getattr(exc, "partial", None):
                    result["measurements"][name] = exc.partial  # type: ignore[attr-defined]
                print(f"gpu: {name} failed: {exc!r}", flush=True)
            else:
                result["measurements"][name] = figures
            result["seconds"][name] = round(time.perf_counter() - t0, 2)
    text = table(result)
    (out / "gpu.txt").write_text(text)
    print(text, end="")
    return result
