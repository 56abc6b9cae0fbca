"""``accelsched demo``: a small cluster that shows every part of accelsched at work.

On a machine where NVML sees GPUs the cluster uses them (through dask-cuda when it is
installed); elsewhere it runs on the fake GPUs of :mod:`accelsched.testing`. Three
phases, each printed as a table built from events (``client.get_events``):

1. **Placement.** Two GPU workers and one CPU-only worker, two of them mis-declared; a
   dask.array pipeline with GPU-annotated steps, each block on its own device.
2. **Leak.** One step leaks device memory on one worker; the guard notices, the worker
   is retired and restarted, and every result still arrives.
3. **Fallback.** The GPU workers retire in the middle of the pipeline; GPU steps that
   cannot be placed within their timeout run their CPU form.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, TextIO

import dask
import dask.array as da
import numpy as np
from distributed import Client, Nanny, Scheduler, SpecCluster, get_worker

import accelsched
from accelsched.devices.nvml import NVMLMonitor

__all__ = ["main"]

DEMO_TOPIC = "accelsched-demo"
MiB = 2**20
_LEAKED: list[Any] = []  # device arrays the leaky step "forgets" (real-GPU path)


# --- pipeline steps (run on workers) ------------------------------------------------


def _record(step: str, block_info: dict | None) -> None:
    try:
        worker = get_worker()
    except ValueError:  # computed locally, for reference
        return
    block = block_info[None]["chunk-location"][0] if block_info else -1
    worker.log_event(
        DEMO_TOPIC,
        {
            "step": step,
            "block": block,
            "worker": worker.address,
            "device": accelsched.current_device(),
        },
    )


def normalise(block: np.ndarray, block_info: dict | None = None) -> np.ndarray:
    """Device-agnostic: numpy on the host, cupy on a real GPU."""
    _record("normalise", block_info)
    xp = accelsched.array_module()
    b = xp.asarray(block)
    out = (b - b.mean()) / (b.std() + 1e-9)
    time.sleep(0.05)  # long enough for blocks to overlap on the two devices
    return _to_numpy(out)


def square(block: np.ndarray, block_info: dict | None = None) -> np.ndarray:
    _record("square", block_info)
    xp = accelsched.array_module()
    time.sleep(0.05)
    return _to_numpy(xp.asarray(block) ** 2)


def leaky_square(block: np.ndarray, block_info: dict | None = None) -> np.ndarray:
    """Like ``square``, but block 0 leaves 1.5 GiB of device memory behind."""
    if block_info and block_info[None]["chunk-location"][0] == 0:
        if _simulated():
            from accelsched.testing import device_alloc

            device_alloc(1536 * MiB, leak=True)
        else:
            import cupy

            _LEAKED.append(cupy.zeros(1536 * MiB // 8))
    return square(block, block_info)


def _simulated() -> bool:
    import os

    return bool(os.environ.get("ACCELSCHED_FAKE_NVML_DIR"))


def _to_numpy(x: Any) -> np.ndarray:
    return x.get() if hasattr(x, "get") and not isinstance(x, np.ndarray) else x


def blocks(step2: Callable[..., np.ndarray] = square) -> da.Array:
    """Two GPU steps over 8 blocks."""
    x = da.random.default_rng(42).random((2000, 500), chunks=(250, 500))
    with dask.annotate(resources={"GPU": 1}):
        y = x.map_blocks(normalise, dtype="f8")
        return y.map_blocks(step2, dtype="f8")


def pipeline(step2: Callable[..., np.ndarray] = square) -> da.Array:
    return blocks(step2).sum(axis=1)


# --- the cluster --------------------------------------------------------------------


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
        print(
            f"No GPU visible to NVML here: running on {fake.count} simulated 16 GiB GPUs "
            "(accelsched.testing.fake_gpus, served through the real pynvml).",
            file=out,
        )
        yield 0


# --- output -------------------------------------------------------------------------


def _table(rows: list[list[str]], header: list[str], out: TextIO) -> None:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = "  ".join("-" * w for w in widths)
    print("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)), file=out)
    print(line, file=out)
    for r in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)), file=out)
    print(file=out)


def _events(client: Client, topic: str, since: float) -> list[dict[str, Any]]:
    return [m for t, m in client.get_events(topic) if t >= since]


def _placement_table(
    client: Client,
    since: float,
    names: dict[str, str],
    uuids: dict[tuple[str, int], str],
    out: TextIO,
) -> None:
    fallbacks = {}
    for e in _events(client, accelsched.events.TOPIC, since):
        if e["action"] == "fallback":
            fallbacks[e["key"]] = e
    rows = []
    seen = set()
    for e in sorted(
        _events(client, DEMO_TOPIC, since), key=lambda e: (e["step"] != "normalise", e["block"])
    ):
        ident = (e["step"], e["block"])
        if ident in seen:
            continue
        seen.add(ident)
        if e["device"] is None:
            where = "CPU (fallback)" if fallbacks else "CPU"
        else:
            uuid = uuids.get((e["worker"], e["device"]), "")
            where = f"GPU {e['device']} {uuid[:12]}"
        rows.append([e["step"], str(e["block"]), names.get(e["worker"], e["worker"]), where])
    _table(rows, ["step", "block", "worker", "ran on"], out)
    if fallbacks:
        reasons: dict[str, int] = {}
        for e in fallbacks.values():
            reasons[e["reason"]] = reasons.get(e["reason"], 0) + 1
        waited = max(e["waited"] for e in fallbacks.values())
        print(
            f"{len(fallbacks)} GPU task(s) fell back to their CPU form "
            f"({', '.join(f'{n} {r}' for r, n in reasons.items())}; longest wait {waited:.2f}s).",
            file=out,
        )


def _event_lines(client: Client, since: float, names: dict[str, str], out: TextIO, skip=()) -> None:  # type: ignore[no-untyped-def]
    for e in _events(client, accelsched.events.TOPIC, since):
        if e["action"] in skip:
            continue
        print(f"  [{e['action']}] {accelsched.events.describe(e, names)}", file=out)
    print(file=out)


def _uuids(client: Client) -> dict[tuple[str, int], str]:
    """(worker address, CUDA index) -> GPU UUID, from the verification events."""
    out = {}
    for e in _events(client, accelsched.events.TOPIC, 0):
        if e["action"] == "gpu-verified":
            for d in e["devices"]:
                out[(e["worker"], d["index"])] = d["uuid"]
    return out


def _names(client: Client) -> dict[str, str]:
    info = client.scheduler_info(n_workers=-1)["workers"]
    return {addr: str(w["name"]) for addr, w in info.items()}


def _wait(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"demo: timed out waiting for {what}")
        time.sleep(0.05)


# --- phases -------------------------------------------------------------------------


@contextlib.contextmanager
def _cluster(real: int, out: TextIO) -> Iterator[SpecCluster]:
    """Real GPUs through dask-cuda when it is installed; plain nannies otherwise."""
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
            cluster.worker_spec["cpu"] = specs["cpu"]
            cluster.sync(cluster._correct_state)
            yield cluster
        return
    with SpecCluster(
        workers=specs,
        scheduler={"cls": Scheduler, "options": {"dashboard_address": ":0"}},
        silence_logs=logging.CRITICAL,
    ) as cluster:
        yield cluster


def run(out: TextIO = sys.stdout) -> int:
    for name in ["distributed", *logging.root.manager.loggerDict]:
        if name.startswith("distributed"):
            logging.getLogger(name).setLevel(logging.ERROR)
    with _gpus(out) as real, _cluster(real, out) as cluster, Client(cluster) as client:
        client.wait_for_workers(len(cluster.workers))
        accelsched.register(
            client,
            fallback_timeout="1s",
            check_interval="200ms",
            leak_threshold="1GiB",
            leak_confirmations=2,
        )
        t0 = 0.0
        _wait(
            lambda: (
                sum(1 for e in _events(client, "accelsched", t0) if e["action"] == "gpu-verified")
                >= 1 + (real != 1)
            ),
            30,
            "GPU verification",
        )
        time.sleep(0.5)
        names = _names(client)
        print("\n== 1. Verified inventory: declarations are checked against NVML ==", file=out)
        _event_lines(client, t0, names, out)
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

        print("== 1b. A GPU pipeline: every GPU step on a verified device ==", file=out)
        t1 = time.time()
        expected = pipeline().compute(scheduler="sync")
        on_gpu = client.compute(pipeline(), optimize_graph=False).result()
        _placement_table(client, t1, names, _uuids(client), out)
        np.testing.assert_allclose(on_gpu, expected)

        print("== 2. A leaking step: detected, worker restarted, nothing lost ==", file=out)
        t2 = time.time()
        kept = client.persist(blocks(leaky_square), optimize_graph=False)
        leaked = client.compute(kept.sum(axis=1)).result()
        _wait(
            lambda: any(e["action"] == "restart" for e in _events(client, "accelsched", t2)),
            60,
            "the leaking worker's restart",
        )
        _wait(
            lambda: len(client.scheduler_info(n_workers=-1)["workers"]) == len(names),
            60,
            "the restarted worker",
        )
        restarted = {
            e["worker"] for e in _events(client, "accelsched", t2) if e["action"] == "restart"
        }
        untouched = {a for a in names if a not in restarted}
        names = {**names, **_names(client)}
        _event_lines(client, t2, names, out, skip=("gpu-verified", "gpu-corrected"))
        again = client.compute(kept.sum(axis=1)).result()  # from the persisted blocks
        np.testing.assert_allclose(again, expected)
        np.testing.assert_allclose(leaked, expected)
        assert untouched <= set(_names(client)), "a peer worker was restarted"
        ran = [e for e in _events(client, DEMO_TOPIC, t2) if e["step"] == "square"]
        assert len(ran) == kept.npartitions, f"blocks recomputed: {len(ran)} runs"
        print(
            f"All {kept.npartitions} persisted blocks survived the restart, none recomputed; the "
            f"{len(again)} sums match the host computation; "
            f"only {', '.join(sorted(names[w] for w in restarted))} restarted, "
            f"its peers ({', '.join(sorted(names[w] for w in untouched))}) kept running.\n",
            file=out,
        )

        print("== 3. GPU workers retire mid-pipeline: GPU steps fall back to CPU ==", file=out)
        t3 = time.time()
        gpu_workers = sorted({w for w, _ in _uuids(client)} & set(_names(client)))
        fut = client.compute(pipeline(), optimize_graph=False)
        _wait(lambda: len(_events(client, DEMO_TOPIC, t3)) >= 2, 30, "the first GPU blocks")
        client.retire_workers(gpu_workers)
        fell_back = fut.result()
        _placement_table(client, t3, {**names, **_names(client)}, _uuids(client), out)
        np.testing.assert_allclose(fell_back, expected)
        print("Same numbers on the GPU path and the fallback path.", file=out)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run()
