"""``python -m benchmarks --quick`` runs and writes what the README's figures come from.

The benchmarks run as the user runs them: ``python -m benchmarks --quick`` subprocesses
(two side by side, each with some of the benchmarks, the real-GPU one dry-run on
simulated GPUs after one of them) with their own clusters of workers on simulated GPUs.
The quick run is a smoke run of seconds per benchmark. The checks are on what they wrote
(keys present, counts that must hold on any machine, valid PNGs, the provenance every
result file carries), never on how fast anything was.

CI runs it as a stage of its own (``pytest -m benchmarks``, with its own time limit);
the README's test command leaves it out, so the suite is about the library.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import dask
import distributed
import pytest

import benchmarks
from benchmarks.gpu.costs import BENCHES as GPU_BENCHES
from benchmarks.micro import hotpath as bench_hotpath
from benchmarks.micro import scale as bench_scale
from benchmarks.micro.worker_threads import ROLES
from benchmarks.studies import soak_plan
from tests.utils import ROOT

pytestmark = pytest.mark.benchmarks

MINE = tuple(benchmarks.NAMES)  # every benchmark, as `python -m benchmarks --quick` runs them
PNG = b"\x89PNG\r\n\x1a\n"
#: Folders whose modules each benchmark is, or helps one (held to the package's length).
FOLDERS = ("harness", "micro", "studies", "gpu")


#: About half the quick run's time: these run beside the others. The quick run mostly
#: waits for worker processes to start, so two runs side by side use both cores of a
#: small machine.
BESIDE = ("leak", "attribution", "scale", "soak")


def _command(out: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "benchmarks", "--quick", "--out", str(out), *args]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("bench")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELSCHED_FAKE")}
    beside = [n for n in MINE if n in BESIDE]
    # the real-GPU benchmark's dry run follows the shorter group, in the same slot
    groups = [[_command(out, *beside)], [_command(out, *[n for n in MINE if n not in beside])]]
    groups[0].append(_command(out, "gpu", "--fake"))
    runs = []
    try:
        for i, commands in enumerate(groups):
            log = (out / f"run-{i}.log").open("w")  # a pipe left unread would block it
            script = " && ".join(subprocess.list2cmdline(c) for c in commands)
            proc = subprocess.Popen(
                ["/bin/sh", "-c", script], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
            )
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
    return out, {n: json.loads((out / f"{n}.json").read_text()) for n in (*MINE, "gpu")}


def _runs(source: Path) -> bool:
    """Whether a module defines ``run`` at its top level: a benchmark, not a helper."""
    tree = ast.parse(source.read_text())
    return any(isinstance(n, ast.FunctionDef) and n.name == "run" for n in tree.body)


def test_registry_lists_every_module() -> None:
    found = {
        ".".join(p.relative_to(ROOT).with_suffix("").parts)
        for folder in FOLDERS
        for p in (ROOT / "benchmarks" / folder).glob("*.py")
        if _runs(p)
    }
    assert found == {b.module for b in benchmarks.REGISTRY.values()}
    assert set(benchmarks.NAMES) == {n for n, b in benchmarks.REGISTRY.items() if b.kind != "gpu"}
    assert {b.kind for b in benchmarks.REGISTRY.values()} == set(benchmarks.KINDS)


def test_no_module_over_about_300_lines() -> None:
    """The package's rule (tests/test_architecture.py) holds here too."""
    long = {
        str(p.relative_to(ROOT)): n
        for p in (ROOT / "benchmarks").rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 310
    }
    assert not long, long


def test_no_command_line_but_the_one() -> None:
    """Only ``python -m benchmarks`` parses arguments: no module keeps a second one."""
    for p in (ROOT / "benchmarks").rglob("*.py"):
        if p.name == "__main__.py":
            continue
        text = p.read_text()
        assert "argparse" not in text and "__name__ ==" not in text, p


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "benchmarks", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_unknown_name_is_refused_naming_it() -> None:
    proc = _cli("--quick", "nosuch")
    assert proc.returncode == 2 and "nosuch" in proc.stderr


def test_list_and_help_name_every_benchmark() -> None:
    for flag in ("--list", "--help"):
        proc = _cli(flag)
        assert proc.returncode == 0, proc.stderr
        for name, b in benchmarks.REGISTRY.items():
            assert name in proc.stdout and b.summary() in proc.stdout, (flag, name)


def test_an_option_of_another_benchmark_is_refused() -> None:
    proc = _cli("--quick", "--rounds", "5", "fallback")
    assert proc.returncode == 2
    assert "--rounds" in proc.stderr and "fallback" in proc.stderr and "overhead" in proc.stderr


def test_placement_cost_splits_a_large_cluster_over_hosts() -> None:
    """No host holds more workers than the simulated library has MIG devices (beyond,
    workers found no device and 256 never got verified); the split is even."""
    from benchmarks.micro import worker_hosts

    assert worker_hosts.split(64) == [64]
    assert worker_hosts.split(128) == [128]
    assert worker_hosts.split(129) == [65, 64]
    assert worker_hosts.split(256) == [128, 128]
    assert worker_hosts.split(300) == [100, 100, 100]


@pytest.mark.timeout(300)
def test_placement_cost_one_size_is_drawn_beside_the_earlier_sizes(tmp_path: Path) -> None:
    """``--workers N`` measures that size only; the sizes of the results it replaces are
    kept, with the run they came from, and drawn with it."""
    row = {
        "workers": 8,
        "scheduler_cpu_us_per_task": {
            k: {"median": 1.0} for k in ("plain", "count", "requirement")
        },
        "bytes_per_waiting_task": {"plain": 1, "count": 1, "requirement": 1},
    }
    earlier = {"quick": False, "sizes": [row], "provenance": {"git": {"commit": "abc"}}}
    (tmp_path / "placement_cost.json").write_text(json.dumps(earlier))
    proc = _cli(
        "placement_cost",
        "--quick",
        "--workers",
        "3",
        "--rounds",
        "1",
        "--out",
        str(tmp_path),
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "placement_cost.json").read_text())
    assert "errors" not in result, result.get("errors")
    assert [(r["workers"], r["hosts"], r["rounds"]) for r in result["sizes"]] == [(3, 1, 1)]
    assert [(r["workers"], r["from"]["commit"]) for r in result["earlier"]] == [(8, "abc")]
    assert (tmp_path / "placement_cost.png").read_bytes().startswith(PNG)


def _gpu_listed() -> bool:
    if shutil.which("nvidia-smi") is None:
        return False
    proc = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    return proc.returncode == 0 and "GPU " in proc.stdout


def test_gpu_refuses_cleanly_without_a_gpu(tmp_path: Path) -> None:
    if _gpu_listed():
        pytest.skip("a GPU is here: the real run would start")
    proc = _cli("gpu", "--quick", "--out", str(tmp_path))
    assert proc.returncode == 3, proc.stderr
    assert "gpu refused" in proc.stderr and "--fake" in proc.stderr
    assert "Traceback" not in proc.stderr and not list(tmp_path.iterdir())


def test_the_runner_and_the_gpu_benchmark_load_no_plotting() -> None:
    """The GPU image has no matplotlib: the command line and the GPU benchmark must not
    need it (the others plot, and are not run there)."""
    code = (
        "import sys, benchmarks.__main__, benchmarks.gpu.costs; "
        "assert 'matplotlib' not in sys.modules and 'psutil' not in sys.modules"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def _head() -> str | None:
    proc = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True)
    return proc.stdout.decode().strip() if proc.returncode == 0 else None


@pytest.mark.timeout(900)
def test_every_result_records_its_provenance(results: tuple[Path, dict[str, Any]]) -> None:
    """Commit, versions, machine and command in every result file, so that a figure can
    be compared with another run's."""
    for name, figures in results[1].items():
        prov = figures["provenance"]
        head = _head()
        if head is not None:  # a checkout without its history records why instead
            assert prov["git"]["commit"] == head and isinstance(prov["git"]["dirty"], bool)
        versions = prov["versions"]
        assert versions["dask"] == dask.__version__
        assert versions["distributed"] == distributed.__version__
        assert versions["accelsched"] and versions["numpy"] and versions["pynvml"], versions
        assert "cupy" in versions
        machine = prov["machine"]
        assert machine["cpus"] >= 1 and machine["memory_bytes"] > 0, machine
        assert machine["cpu_model"] and machine["os"] and machine["python"], machine
        loads = machine["load_average"]
        assert len(loads["start"]) == len(loads["end"]) == 3, loads
        assert prov["command"].startswith("python -m benchmarks --quick"), prov["command"]
        assert f" {name}" in prov["command"] and prov["seconds"] > 0


@pytest.mark.timeout(900)
def test_gpu_dry_run_figures(results: tuple[Path, dict[str, Any]]) -> None:
    out, figures = results
    gpu = figures["gpu"]
    assert gpu["kind"] == "gpu" and gpu["environment"]["mode"] == "fake"
    assert not gpu["errors"], gpu["errors"]
    assert set(gpu["measurements"]) == {name for name, _ in GPU_BENCHES}
    assert gpu["measurements"]["cluster"]["leak_and_restart"]["kept_result_survived"] is True
    # the GPU worker's CPU per tiny task on both sides, as issue 27's target reads it
    tasks = gpu["measurements"]["cluster"]["cluster_tasks"]
    assert tasks["worker_cpu_without_us"] > 0 and tasks["worker_cpu_with_us"] > 0
    assert 0 < tasks["worker_cpu_ratio"]["min"] <= tasks["worker_cpu_ratio"]["max"]
    assert "NOT GPU FIGURES" in (out / "gpu.txt").read_text()


@pytest.mark.timeout(900)
def test_every_benchmark_writes_json_and_png(results: tuple[Path, dict[str, Any]]) -> None:
    out, figures = results
    for name in MINE:
        assert figures[name]["name"] == name and figures[name]["quick"] is True
        assert figures[name]["kind"] == benchmarks.REGISTRY[name].kind
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
    for config in ("cli", "in_process"):  # both configurations, every kind paired
        for kind in ("gpu", "cpu"):
            figures = overhead[config][kind]
            rounds = figures["rounds"]
            assert len(rounds["plain"]) == len(rounds["accelsched"]) == overhead["rounds"] >= 5
            assert all(r["wall"] > 0 for r in rounds["plain"] + rounds["accelsched"])
            assert set(figures["worker_cpu_us_per_task"]) == {"plain", "accelsched", "delta"}
            # and by thread: each worker's event loop and executor thread named (two
            # workers a side, one thread each), every role's CPU paired
            threads = figures["worker_thread_cpu_us_per_task"]
            assert set(threads) == set(ROLES)
            assert all(set(t) == {"plain", "accelsched", "delta"} for t in threads.values())
            assert all(
                set(r["threads_us"]) == set(ROLES) for r in rounds["plain"] + rounds["accelsched"]
            )
            if config == "cli":  # (in process, a fresh cluster a round: not kept)
                assert figures["threads_named"] == {
                    side: {"executor": 2, "event loop": 2} for side in ("plain", "accelsched")
                }
    # the guard's measurement: at most one read a task, on a sample of a quiet prefix's
    # runs (accelsched.policy.leak: its first four runs on each worker at least)
    read = overhead["cli"]["gpu"]["nvml_read"]
    assert read["reads"] >= 4 and read["reads_per_task"] <= 3 and read["wall_us"]["median"] > 0
    # without a context no reading can be a base: tasks are not read around
    assert overhead["cli"]["gpu"]["nvml_read_no_context"]["reads_per_task"] < 0.5
    # GPU tasks once every worker of both sides made a CUDA context: paired rounds with
    # the worker CPU per task on both sides, its difference and ratio; the guard, settled,
    # reads NVML around a sample of the tasks, not every one
    context = overhead["cli"]["gpu_context"]
    both = context["rounds"]["plain"] + context["rounds"]["accelsched"]
    assert len(context["rounds"]["plain"]) == overhead["context_rounds"] >= 1
    assert len(both) == 2 * overhead["context_rounds"]
    assert all(r["wall"] > 0 and r["worker_us"] >= 0 for r in both)
    assert set(context["worker_cpu_us_per_task"]) == {"plain", "accelsched", "delta"}
    assert set(context["worker_thread_cpu_us_per_task"]) == set(ROLES)
    assert context["threads_named"] == overhead["cli"]["gpu"]["threads_named"]
    assert context["wall_ratio"]["min"] > 0
    assert context["worker_cpu_ratio"] is None or context["worker_cpu_ratio"]["min"] >= 0
    assert context["nvml_read"]["reads_per_task"] < 0.5
    assert "gpu_context" not in overhead["in_process"]  # the command line's only
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
    # the hook's function calls were counted (over a round of their own): its own
    # calls, one per transition, and what it calls, many more
    assert hot["hook_function_calls"] >= hot["loop_calls_per_task"] >= 5
    assert hot["context"]["hook_calls"] >= hot["loop_calls_per_task"]


@pytest.mark.timeout(900)
def test_soak_figures(results: tuple[Path, dict[str, Any]]) -> None:
    """Every task of the soak ended, every fault kind struck, leaks restarted workers."""
    soak = results[1]["soak"]
    assert soak["stuck"] == {} and "errors" not in soak, soak.get("errors")
    tasks = soak["tasks"]
    assert tasks["ended"] == tasks["submitted"] > 0
    ended = sum(n for outcomes in tasks["outcomes"].values() for n in outcomes.values())
    assert ended == tasks["submitted"]
    assert set(soak["faults"]["by_kind"]) == {"late-join", *soak_plan.KINDS}
    assert soak["events"]["restarts"].get("leak", 0) >= 1
    assert set(tasks["per_worker"]) <= {s.name for s in soak_plan.WORKERS}


def test_soak_plan_is_the_seeds() -> None:
    """The faults come from the seed alone (a run can be repeated), within the load,
    every kind at least once, about 44 in 10 minutes, the late worker joining early."""
    faults = soak_plan.plan(3, 600, 44)
    assert faults == soak_plan.plan(3, 600, 44) != soak_plan.plan(4, 600, 44)
    assert len(faults) == 44 and [f.at for f in faults] == sorted(f.at for f in faults)
    assert all(0 < f.at < 600 for f in faults)
    assert {f.kind for f in faults} == {"late-join", *soak_plan.KINDS}
    (late,) = [f for f in faults if f.kind == "late-join"]
    assert late.at < 0.4 * 600 and late.target == "t4x2"
    devices = {int(f.target) for f in faults if f.kind == "nvml"}
    assert devices <= set(range(len(soak_plan.DEVICES)))
    assert len(soak_plan.plan(3, 50, 6)) == 6


@pytest.mark.timeout(900)
def test_elastic_figures(results: tuple[Path, dict[str, Any]]) -> None:
    """Every setup ran the same workload to the end, every GPU task on a GPU (a 60 s
    fallback timeout: the pools start in seconds), and the worker-seconds agree with each
    setup's shape: the fixed cluster 2 + 2 workers for the whole run, distributed's
    Adaptive GPU workers only, the elastic pools at most their maxima; both adaptive
    setups gave every worker back after the work."""
    elastic = results[1]["elastic"]
    w = elastic["setup"]
    gpu_tasks = w["bursts"] * w["burst"]
    cpu_tasks = int((w["bursts"] - 1) * w["period"] / w["cpu_every"]) + 1
    for setup, runs in elastic["runs"].items():
        assert len(runs) == w["rounds"], setup
        for r in runs:
            assert (r["gpu_tasks"], r["cpu_tasks"]) == (gpu_tasks, cpu_tasks), setup
            assert r["gpu_tasks_on_gpu"] == gpu_tasks and r["fallbacks"] == 0, (setup, r)
            assert len(r["burst_seconds"]) == w["bursts"] and min(r["burst_seconds"]) > 0
            assert 0 < r["finish_seconds"] <= r["window_seconds"], (setup, r)
            window = r["window_seconds"]
            if setup == "fixed":
                assert r["window_seconds"] == r["finish_seconds"] and r["shrunk"] is None
                for pool in ("gpu", "cpu"):  # two workers each, there before it started
                    assert r[f"{pool}_worker_seconds"] == pytest.approx(2 * window, rel=0.01)
                    assert r[f"{pool}_worker_starts"] == 0
                continue
            assert r["shrunk"] is True, (setup, r)  # all given back within the tail
            assert all(steps[-1][1] == 0 for steps in r["steps"].values()), (setup, r)
            assert r["gpu_worker_starts"] >= 1 and r["gpu_worker_seconds"] > 0, (setup, r)
            if setup == "adaptive":  # one pool: its GPU workers ran the CPU stream too
                assert r["cpu_worker_seconds"] == 0 and r["cpu_worker_starts"] == 0
                assert r["gpu_worker_seconds"] <= 4 * window
            else:
                assert r["cpu_worker_starts"] >= 1 and r["scale_up_events"] >= 2, r
                assert r["gpu_worker_seconds"] <= 2 * window
                assert r["cpu_worker_seconds"] <= 2 * window
    assert set(elastic["summary"]) == {"elastic", "fixed", "adaptive"}
