"""The overhead benchmark's plot, from its figures (kept apart so that the benchmark's
module stays about measuring)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

CONFIGS = {"cli": "command line", "in_process": "in process"}
#: Kinds of task rounds, in the order drawn; a configuration draws those it ran (the
#: rounds with a CUDA context are the command line's only).
KINDS = {"gpu": "gpu", "gpu_context": "gpu, context", "cpu": "cpu"}


def plot(result: dict[str, Any], out: Path) -> list[Path]:
    """Per configuration (a row each): per-round wall ratio and CPU per task, every kind
    of task side by side."""
    from benchmarks.harness.plots import plt, save  # the Agg backend, as every benchmark draws

    fig, grid = plt.subplots(len(CONFIGS), 3, figsize=(13, 3.6 * len(CONFIGS)), squeeze=False)
    for axes, (config, title) in zip(grid, CONFIGS.items(), strict=True):
        figures = result[config]
        kinds = [k for k in KINDS if k in figures]
        ratios = [
            [
                a["wall"] / p["wall"]
                for p, a in zip(
                    figures[k]["rounds"]["plain"], figures[k]["rounds"]["accelsched"], strict=True
                )
            ]
            for k in kinds
        ]
        axes[0].boxplot(ratios, tick_labels=[f"{KINDS[k]}\ntasks" for k in kinds])
        axes[0].axhline(1.0, color="grey", lw=0.8)
        axes[0].axhline(1.03, color="red", lw=0.8, ls="--", label="target 1.03")
        axes[0].set_ylabel("wall time, accelsched / plain")
        axes[0].set_title(title, fontsize=9, loc="left")
        axes[0].legend(fontsize=8)
        axes[0].tick_params(axis="x", labelsize=7)
        scheduler_label = "scheduler CPU µs per task"
        if config == "in_process":
            scheduler_label = "scheduler + client CPU µs per task"
        for ax, figure, label in (
            (axes[1], "worker_us", "worker CPU µs per task"),
            (axes[2], "sched_us", scheduler_label),
        ):
            data, labels = [], []
            for k in kinds:
                for name in ("plain", "accelsched"):
                    data.append([r[figure] for r in figures[k]["rounds"][name]])
                    labels.append(f"{KINDS[k]}\n{name}")
            ax.boxplot(data, tick_labels=labels)
            ax.set_ylabel(label, fontsize=8)
            ax.tick_params(axis="x", labelsize=6)
    context = result["cli"].get("gpu_context", {}).get("rounds", {}).get("plain", [])
    fig.suptitle(
        f"{result['tasks']} tiny tasks, {result['rounds']} paired rounds "
        f"({len(context)} with a CUDA context, command line)"
    )
    fig.tight_layout()
    return [save(fig, out / "overhead.png", dpi=110)]
