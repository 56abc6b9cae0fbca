"""``python -m benchmarks --quick`` runs and writes what the README's figures come from.

The benchmarks run as the user runs them: ``python -m benchmarks --quick`` subprocesses
(two side by side, each with some of the benchmarks) with their own clusters of workers
on simulated GPUs. The quick run is a smoke run of seconds per benchmark. The checks are
on what they wrote (keys present, counts that must hold on any machine, valid PNGs),
never on how fast anything was.

CI runs it as a stage of its own (``pytest -m benchmarks``, with its own time limit);
the README's test command leaves it out, so the suite is about the library.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import benchmarks
from benchmarks import bench_hotpath, bench_scale
from tests.utils import ROOT

pytestmark = pytest.mark.benchmarks

MINE = tuple(benchmarks.NAMES)  # every benchmark, as `python -m benchmarks --quick` runs them
PNG = b"\x89PNG\r\n\x1a\n"


#: About half the quick run's time: these run beside the others. The quick run mostly
#: waits for worker processes to start, so two runs side by side use both cores of a
#: small machine.
BESIDE = ("leak", "attribution", "scale")


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("bench")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELSCHED_FAKE")}
    groups = [[n for n in MINE if n in BESIDE], [n for n in MINE if n not in BESIDE]]
    runs = []
    try:
        for i, names in enumerate(groups):
            log = (out / f"run-{i}.log").open("w")  # a pipe left unread would block it
            cmd = [sys.executable, "-m", "benchmarks", "--quick", "--out", str(out), *names]
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
            runs.append((proc, log))
        for proc, log in runs:
            code = proc.wait(timeout=600)
            log.close()
            assert code == 0, Path(log.name).read_text()[-6000:]
    finally:
        for proc, log in runs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    return out, {n: json.loads((out / f"{n}.json").read_text()) for n in MINE}


def test_registry_lists_every_module() -> None:
    names = {p.stem.removeprefix("bench_") for p in (ROOT / "benchmarks").glob("bench_*.py")}
    assert names == set(benchmarks.NAMES)


def test_unknown_name_is_refused_naming_it() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "nosuch"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "nosuch" in proc.stderr


@pytest.mark.timeout(900)
def test_every_benchmark_writes_json_and_png(results: tuple[Path, dict[str, Any]]) -> None:
    out, figures = results
    for name in MINE:
        assert figures[name]["name"] == name and figures[name]["quick"] is True
        pngs = list(out.glob(f"{name}*.png"))
        assert pngs, name
        for png in pngs:
            assert png.read_bytes()[:8] == PNG, png


@pytest.mark.timeout(900)
def test_leak_figures(results: tuple[Path, dict[str, Any]]) -> None:
    leak = results[1]["leak"]
    summary = leak["summary"]
    assert set(summary) >= {
        "a no guard",
        "b fresh process per task",
        "c lifetime 5 s",
        "d accelsched",
        "d accelsched, stream of 4",
    }
    for label, runs in leak["runs"].items():
        for r in runs:  # every task accounted for, every result the right one
            assert r["finished"] + r["oom_failed"] + r["other_failed"] == r["tasks"], label
            assert r["wrong"] == 0, label
            assert all(0 < p <= leak["setup"]["memory"] for p in r["peak_bytes"]), label
    (b,) = leak["runs"]["b fresh process per task"]
    assert b["restarts"] == b["tasks"] and b["results_lost"] == 0
    assert summary["a no guard"]["restarts"]["max"] == 0
    assert leak["runs"]["d accelsched, stream of 4"][0]["restarts"] >= 1
    for d in ("d accelsched", "d accelsched, stream of 4"):
        targets = leak["targets"][d]
        assert set(targets) == {
            "throughput_vs_per_task",
            "throughput_met",
            "throughput_vs_no_guard",
            "no_guard_met",
            "oom_met",
            "peak_met",
            "lost_met",
        }
        assert targets["throughput_vs_per_task"] > 0 and targets["throughput_vs_no_guard"] > 0
        assert all(isinstance(targets[k], bool) for k in targets if k.endswith("_met"))


@pytest.mark.timeout(900)
def test_detection_figures(results: tuple[Path, dict[str, Any]]) -> None:
    det = results[1]["detection"]
    assert len(det["false_positives"]) == 6
    assert all(isinstance(n, int) and n >= 0 for n in det["false_positives"].values())
    by_factor = {s["factor"]: s for s in det["sweep"]}
    # a leak of 2x the threshold crosses it in one run; one of 0.5x needs three (2 x 0.5
    # is not above it)
    assert by_factor[2.0]["detected"] and by_factor[2.0]["runs"] == 1
    assert by_factor[0.5]["detected"] and by_factor[0.5]["runs"] == 3
    assert det["attribution_runs"] == 2


@pytest.mark.timeout(900)
def test_existing_benchmarks_figures(results: tuple[Path, dict[str, Any]]) -> None:
    figures = results[1]
    assert [r["timeout_s"] for r in figures["fallback"]["single"]] == [0, 0.25]
    assert all(r["waited_median_s"] >= r["timeout_s"] for r in figures["fallback"]["single"])
    assert len(figures["guard"]["trials"]) == 1
    assert all(t["checks_above_threshold"] == 2 for t in figures["guard"]["trials"])
    attribution = figures["attribution"]
    assert attribution["fused"]["runs"] == attribution["unfused"]["runs"] == 1


@pytest.mark.timeout(900)
def test_overhead_and_scale_figures(results: tuple[Path, dict[str, Any]]) -> None:
    overhead, scale = results[1]["overhead"], results[1]["scale"]
    for kind in ("gpu", "cpu"):
        rounds = overhead[kind]["rounds"]
        assert len(rounds["plain"]) == len(rounds["accelsched"]) == overhead["rounds"] >= 5
        assert all(r["wall"] > 0 for r in rounds["plain"] + rounds["accelsched"])
        assert set(overhead[kind]["worker_cpu_us_per_task"]) == {"plain", "accelsched", "delta"}
    read = overhead["gpu"]["nvml_read"]  # the guard's measurement: about one read a task
    assert 0.5 <= read["reads_per_task"] <= 3 and read["wall_us"]["median"] > 0
    # without a context no reading can be a base: tasks are not read around
    assert overhead["gpu"]["nvml_read_no_context"]["reads_per_task"] < 0.5
    assert {(r["unrunnable"], r["timeout"]) for r in scale["check"]} == {
        (n, t) for n in bench_scale.QUICK_SIZES for t in ("1h", None)
    }
    assert [h["tasks"] for h in scale["hooks"]] == ["plain", "gpu", "gpu+timeout"]
    burst = scale["burst"]  # every task fell back, told in one event
    assert burst["fallback_events"] == 1 and burst["counted"] == burst["tasks"]
    workers = scale["workers"]  # every simulated (MIG) device verified, one per worker
    assert workers["verified"] == workers["workers"] == 7
    assert scale["trickle"]["rounds"] == 2


@pytest.mark.timeout(900)
def test_hotpath_figures(results: tuple[Path, dict[str, Any]]) -> None:
    """The guard's per-task work, piece by piece: every piece the benchmark names still
    exists in the code (a renamed one would silently drop out of the budget)."""
    hot = results[1]["hotpath"]
    assert len(hot["rounds_detail"]["plain"]) == len(hot["rounds_detail"]["accelsched"])
    assert hot["rounds"] == len(hot["rounds_detail"]["pieces"]) >= 2
    assert set(hot["guard_us_per_task"]) == {"total", "thread", "loop", "budget"}
    assert set(hot["pieces"]) == {label for label, _, _ in bench_hotpath.PIECES}
    assert not [label for label, p in hot["pieces"].items() if p.get("absent")]
    # one lease per GPU task, one runner chosen per task, the hook on every transition
    assert hot["pieces"]["lease acquire"]["calls_per_task"] == 1
    assert hot["pieces"]["choose a runner"]["calls_per_task"] == 1
    assert "constrained->executing" in hot["loop_kinds"]
