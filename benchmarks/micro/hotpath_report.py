"""The hot-path benchmark's printed report and plot, from its figures."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any


def med(values: list[float]) -> float:
    return round(statistics.median(values), 2) if values else float("nan")


def spread(values: list[float]) -> dict[str, float]:
    return {"median": med(values), "min": round(min(values), 3), "max": round(max(values), 3)}


def report(result: dict[str, Any]) -> str:
    g, alone = result["guard_us_per_task"], result["runner_alone"]
    lines = [
        f"{result['tasks']} tiny GPU tasks x {result['rounds']} rounds, one in-process worker",
        f"guard per task: {g['total']} us (budget {g['budget']:g}): thread {g['thread']} us "
        f"(the runner alone, {alone['runner_us']} - {alone['bare_us']} bare) + loop "
        f"{g['loop']} us ({result['loop_calls_per_task']} hook calls); function calls a "
        f"task: the runner {alone.get('calls', '?')}, the hook "
        f"{result.get('hook_function_calls', '?')}",
        f"executor thread CPU per task in the rounds: {result['thread_cpu_us']}, "
        f"accelsched - plain {result['thread_delta_in_rounds_us']}",
        f"gc gen0 per 1000 tasks (whole process): {result['gc_gen0_per_1000_tasks']}",
        "hook per transition: "
        + ", ".join(
            f"{k} {v['median_us']} us x {v['calls_per_task']}"
            for k, v in result["loop_kinds"].items()
        ),
    ]
    if ctx := result.get("context"):
        lines.append(
            f"with a CUDA context: executor thread CPU per task {ctx['thread_cpu_us']}, "
            f"accelsched - plain {ctx['thread_delta_us']}, ratio {ctx['thread_ratio']}; "
            f"NVML reads per task {ctx['nvml_reads_per_task']}"
        )
        if alone_ctx := ctx.get("runner_alone"):
            lines.append(
                f"  the runner alone with a context: {alone_ctx['guard_us']} us, "
                f"{alone_ctx['calls']} function calls a task (the hook "
                f"{ctx.get('hook_calls', '?')})"
            )
    for label, p in result["pieces"].items():
        if p.get("absent"):
            lines.append(f"  {label:26s} ({p['side']}) absent")
        else:
            lines.append(
                f"  {label:26s} ({p['side']:6s}) {p['us_per_task']:7.2f} us/task "
                f"({p['calls_per_task']} calls, {p['median_us']} us each)"
            )
    if result["tasks"] < 2000:
        lines.append(
            f"quick run: not the README's figures: {result['tasks']} tasks a round, not 2000, "
            "so what a round pays once (the first NVML reads, the warm-up) weighs more per task"
        )
    return "\n".join(lines)


def plot(result: dict[str, Any], out: Path) -> list[Path]:
    """The pieces' µs per task, by side, against the budget."""
    from benchmarks.harness.plots import plt, save  # the Agg backend, as every benchmark draws

    present = [(k, p) for k, p in result["pieces"].items() if not p.get("absent")]
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(present) + 1.6))
    labels = [f"{k} ({p['side']})" for k, p in present]
    ax.barh(labels, [p["us_per_task"] for _, p in present], color="tab:blue")
    g = result["guard_us_per_task"]
    ax.set_xlabel("µs per GPU task (median call × calls per task)")
    ax.set_title(
        f"guard per task {g['total']} µs (budget {g['budget']:g}): "
        f"runner {g['thread']} + hook {g['loop']}",
        fontsize=10,
    )
    ax.invert_yaxis()
    return [save(fig, out / "hotpath.png", dpi=100)]
