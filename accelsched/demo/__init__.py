"""``accelsched demo``: a small cluster that shows every part of accelsched at work.

On a machine where NVML sees GPUs the cluster uses them (through dask-cuda when it is
installed); elsewhere it runs on the fake GPUs of :mod:`accelsched.testing`. Three
phases, each printed as a table built from events (``client.get_events``):

1. **Placement.** Two GPU workers and one CPU-only worker, two of them mis-declared; a
   dask.array pipeline whose GPU steps are marked in code (``@accelsched.gpu``), with
   dask's default optimisation, each block on its own device.
2. **Leak.** One step leaks device memory on one worker; the guard notices, the worker
   is retired and restarted, and every result still arrives.
3. **Fallback.** The GPU workers retire in the middle of the pipeline; GPU steps that
   cannot be placed within their timeout run their CPU form.

Each stage prints one progress line (``[n/6] ...``) when it begins; logging is kept to
errors meanwhile (:mod:`accelsched.demo.quiet`). At the end it writes a standalone HTML
page (:mod:`accelsched.demo.chart`; in the system's temporary folder unless told where):
the device memory of each worker process from the moment the cluster is up, sampled
through NVML (:mod:`accelsched.demo.memory`), with the leak, restart and fallback events
marked.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

import numpy as np
from distributed import Client, Nanny, Scheduler, SpecCluster

import accelsched
from accelsched import internals
from accelsched.demo.chart import default_report, report_path, write_report
from accelsched.demo.memory import Sampler
from accelsched.demo.quiet import quiet_logs
from accelsched.demo.report import event_lines, events, placement_table, uuids, wait, worker_names
from accelsched.demo.steps import DEMO_TOPIC, blocks, leaky_square, pipeline
from accelsched.devices import NVMLMonitor

__all__ = ["STAGES", "Progress", "main", "run"]


def _cluster_specs(real_gpus: int) -> dict[str, dict[str, Any]]:
    def nanny(cvd: str, **resources: float) -> dict[str, Any]:
        options: dict[str, Any] = {
            "nthreads": 2,
            "env": {"CUDA_VISIBLE_DEVICES": cvd},
            "silence_logs": logging.CRITICAL,
        }
        if resources:
            options["resources"] = resources
        return {"cls": Nanny, "options": options}

    if real_gpus >= 2:
        return {"gpu-0": nanny("0", GPU=2), "gpu-1": nanny("1", GPU=1), "cpu": nanny("", GPU=1)}
    if real_gpus == 1:
        return {"gpu-0": nanny("0", GPU=2), "cpu": nanny("", GPU=1), "cpu-2": nanny("")}
    # fake GPUs: gpu-0 declares 2 but owns 1; cpu declares a GPU it does not have
    return {"gpu-0": nanny("0", GPU=2), "gpu-1": nanny("1", GPU=1), "cpu": nanny("", GPU=1)}


def _misdeclared(specs: dict[str, dict[str, Any]]) -> dict[str, tuple[float, int]]:
    """The workers whose declared GPU count is not the GPUs they see, on purpose (the
    demo shows accelsched correcting them): name -> (declared, seen)."""
    out = {}
    for name, spec in specs.items():
        options = spec["options"]
        declared = options.get("resources", {}).get("GPU")
        seen = len([d for d in options["env"]["CUDA_VISIBLE_DEVICES"].split(",") if d])
        if declared is not None and declared != seen:
            out[name] = (declared, seen)
    return out


def _declarations(misdeclared: dict[str, tuple[float, int]]) -> str:
    """The sentence that tells a reader the corrections that follow are the point."""
    parts = [
        f"{name} declares GPU={declared:g} but has {seen or 'none'}"
        + (f" GPU{'s' if seen > 1 else ''}" if seen else "")
        for name, (declared, seen) in sorted(misdeclared.items())
    ]
    return (
        "On purpose, to show the correction, the demo mis-declares "
        f"{len(parts)} worker(s): {'; '.join(parts)}. accelsched checks each against NVML:"
    )


@contextlib.contextmanager
def _gpus(out: TextIO) -> Iterator[int]:
    monitor = NVMLMonitor(env={})
    real = len(monitor.devices())
    if real:
        names = ", ".join(sorted({d.name for d in monitor.devices()}))
        print(f"NVML sees {real} GPU(s): {names}", file=out)
        yield real
        return
    from accelsched.testing import fake_gpus

    with fake_gpus(count=2, memory="16GiB") as fake:
        served = (
            "served by accelsched's pure-Python stand-in for pynvml, as no C compiler "
            "could build the fake libnvidia-ml.so.1: accelsched sees them, distributed's "
            "own GPU diagnostics do not"
            if fake.standin
            else "a fake libnvidia-ml.so.1 served through the real pynvml"
        )
        print(
            f"No GPU visible to NVML here: running on {fake.count} simulated 16 GiB GPUs "
            f"(accelsched.testing.fake_gpus, {served}).",
            file=out,
        )
        yield 0


@contextlib.contextmanager
def _cluster(real: int, out: TextIO) -> Iterator[tuple[SpecCluster, dict[str, tuple[float, int]]]]:
    """Real GPUs through dask-cuda when it is installed; plain nannies otherwise. With
    the cluster, the workers it mis-declares on purpose (:func:`_misdeclared`)."""
    specs = _cluster_specs(real)
    local_cuda_cluster: Any = None
    if real:
        with contextlib.suppress(ImportError):
            import dask_cuda

            local_cuda_cluster = dask_cuda.LocalCUDACluster
    if local_cuda_cluster is not None:
        print("Starting the GPU workers with dask-cuda (LocalCUDACluster).", file=out)
        # dask-cuda gives every worker all GPUs in rotated order; each owns its first.
        with local_cuda_cluster(
            n_workers=min(real, 2),
            threads_per_worker=2,
            resources={"GPU": 2},  # mis-declared on purpose: each owns one
            dashboard_address=":0",
            silence_logs=logging.CRITICAL,
        ) as cluster:
            internals.add_spec_worker(cluster, "cpu", specs["cpu"])
            misdeclared = {str(n): (2.0, 1) for n in cluster.workers if n != "cpu"}
            yield cluster, {**misdeclared, **_misdeclared({"cpu": specs["cpu"]})}
        return
    with SpecCluster(
        workers=specs,
        scheduler={"cls": Scheduler, "options": {"dashboard_address": ":0"}},
        silence_logs=logging.CRITICAL,
    ) as cluster:
        yield cluster, _misdeclared(specs)


STAGES = 6


class Progress:
    """Prints each stage's one progress line (``[n/6] ...``) as it begins, and remembers
    when it began (the report draws the stages on its time axis)."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.began: list[tuple[float, str]] = []

    def __call__(self, n: int, text: str) -> None:
        print(f"[{n}/{STAGES}] {text}", file=self.out, flush=True)
        self.began.append((time.time(), text))


def main(report: str | Path | None = None, out: TextIO = sys.stdout) -> int:
    """``accelsched demo [--report PATH]``: exit 2 with one line for a bad path."""
    try:
        path = report_path(default_report() if report is None else report)
    except ValueError as exc:
        print(f"accelsched demo: {exc}", file=sys.stderr)
        return 2
    return run(out, report=path)


def run(out: TextIO = sys.stdout, report: str | Path | None = None) -> int:
    """Run the three phases, print what happened, write the HTML report to ``report``
    (a ``.html`` file or a folder, checked before anything starts; by default
    :func:`~accelsched.demo.chart.default_report`)."""
    path = report_path(default_report() if report is None else report)
    stage = Progress(out)
    with quiet_logs(), _gpus(out) as real:
        stage(1, "Starting a local cluster: 3 workers, a scheduler with accelsched")
        began = time.time()
        with _cluster(real, out) as (cluster, misdeclared), Client(cluster) as client:
            client.wait_for_workers(len(cluster.workers))
            # the report's time 0: the start-up before it is waiting, not accelsched
            start = time.time()
            with Sampler(client, start) as sampler:
                seen = _phases(client, real, misdeclared, stage, out)
            seen.update(worker_names(client))
            stage(6, "Writing the report")
            written = write_report(
                path,
                sampler.samples,
                client.get_events(accelsched.events.TOPIC),
                seen,
                start,
                stages=stage.began,
                note=(
                    f"Time 0 is when the cluster was up (its start-up, stage 1, took "
                    f"{start - began:.1f} s). "
                    f"Device memory each worker process holds, summed over its GPUs: NVML's "
                    f"per-process figure, read on every worker every {sampler.interval:g} s "
                    f"({'real GPUs' if real else 'simulated GPUs: the figures are the simulation'}"
                    "'s). A line breaks where its worker restarted: a new process. "
                    "Markers: leak (x) and restart (inverted triangle) on the worker's "
                    "line, fallback (triangle) at 0 for tasks the scheduler moved to a CPU, "
                    "with their number beside it when several fell back together. "
                    "Hover a marker for the event."
                ),
            )
    print(f"Report written to {written}", file=out)
    return 0


def _phases(
    client: Client,
    real: int,
    misdeclared: dict[str, tuple[float, int]],
    stage: Progress,
    out: TextIO,
) -> dict[str, str]:
    """Stages 2 to 5; returns every worker address seen, with its name."""
    stage(2, "Verifying each worker's GPUs against NVML")
    print(f"  {_declarations(misdeclared)}", file=out)
    accelsched.register(
        client,
        fallback_timeout="1s",
        check_interval="200ms",
        leak_threshold="1GiB",
        leak_confirmations=2,
    )
    t0 = 0.0
    wait(
        lambda: (
            sum(1 for e in events(client, "accelsched", t0) if e["action"] == "gpu-verified")
            >= 1 + (real != 1)
        ),
        30,
        "GPU verification",
    )
    time.sleep(0.5)
    names = worker_names(client)
    seen = dict(names)
    event_lines(client, t0, names, out, on_purpose=misdeclared)
    resources = client.run_on_scheduler(
        lambda dask_scheduler: {
            str(w.name): w.resources.get("GPU", 0) for w in dask_scheduler.workers.values()
        }
    )
    print(
        "GPU resource the scheduler places against: "
        + ", ".join(f"{n}={v:g}" for n, v in sorted(resources.items()))
        + "\n",
        file=out,
    )

    stage(3, "A GPU pipeline: every GPU step on a verified device")
    t1 = time.time()
    expected = pipeline().compute(scheduler="sync")
    on_gpu = client.compute(pipeline()).result()
    placement_table(client, t1, names, uuids(client), out)
    np.testing.assert_allclose(on_gpu, expected)

    stage(4, "A leaking step: detected, its worker restarted, nothing lost")
    t2 = time.time()
    kept = client.persist(blocks(leaky_square))
    leaked = client.compute(kept.sum(axis=1)).result()
    wait(
        lambda: any(e["action"] == "restart" for e in events(client, "accelsched", t2)),
        60,
        "the leaking worker's restart",
    )
    wait(
        lambda: len(internals.workers_listed(client)) == len(names),
        60,
        "the restarted worker",
    )
    gpu_count = len({w for w, _ in uuids(client)} & set(names))
    wait(
        lambda: len({w for w, _ in uuids(client)} & set(worker_names(client))) == gpu_count,
        60,
        "the restarted worker's GPUs to be verified",
    )
    restarted = {e["worker"] for e in events(client, "accelsched", t2) if e["action"] == "restart"}
    untouched = {a for a in names if a not in restarted}
    names = {**names, **worker_names(client)}
    seen.update(names)
    event_lines(client, t2, names, out, skip=("gpu-verified", "gpu-corrected"))
    again = client.compute(kept.sum(axis=1)).result()  # from the persisted blocks
    np.testing.assert_allclose(again, expected)
    np.testing.assert_allclose(leaked, expected)
    assert untouched <= set(worker_names(client)), "a peer worker was restarted"
    ran = [e for e in events(client, DEMO_TOPIC, t2) if e["step"] == "square"]
    assert len(ran) == kept.npartitions, f"blocks recomputed: {len(ran)} runs"
    print(
        f"All {kept.npartitions} persisted blocks survived the restart, none recomputed; the "
        f"{len(again)} sums match the host computation; "
        f"only {', '.join(sorted(names[w] for w in restarted))} restarted, "
        f"its peers ({', '.join(sorted(names[w] for w in untouched))}) kept running.\n",
        file=out,
    )

    stage(5, "GPU workers retire mid-pipeline: GPU steps fall back to CPU")
    t3 = time.time()
    gpu_workers = sorted({w for w, _ in uuids(client)} & set(worker_names(client)))
    fut = client.compute(pipeline())
    wait(lambda: len(events(client, DEMO_TOPIC, t3)) >= 2, 30, "the first GPU blocks")
    client.retire_workers(gpu_workers)
    fell_back = fut.result()
    placement_table(client, t3, {**names, **worker_names(client)}, uuids(client), out)
    np.testing.assert_allclose(fell_back, expected)
    print("Same numbers on the GPU path and the fallback path.\n", file=out)
    return seen
