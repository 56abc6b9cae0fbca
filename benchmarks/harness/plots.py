"""The benchmarks' pictures, drawn with matplotlib's Agg backend (no display needed)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

GiB = 2**30
COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red")


def save(fig: Any, path: Path, dpi: int = 90) -> Path:
    """Write ``fig`` as a PNG and free it (figures pile up in a long run otherwise)."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def memory_panels(
    path: Path,
    traces: Mapping[str, dict[str, Any]],
    *,
    total: int,
    limit: int | None = None,
    title: str = "",
) -> None:
    """One panel per policy: each device's used memory over time, restart markers.

    ``traces`` maps a panel title to :meth:`benchmarks.harness.sampling.MemoryTrace.as_dict`.
    A dashed line marks the device's total (the hard limit), a dotted one ``limit``.
    """
    n = len(traces)
    cols = 2 if n > 1 else 1
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 2.6 * rows), squeeze=False)
    for ax, (label, trace) in zip(axes.flat, traces.items(), strict=False):
        for d, samples in sorted(trace["used"].items()):
            color = COLORS[int(d) % len(COLORS)]
            if samples:
                t, used = zip(*samples, strict=True)
                ax.plot(t, [u / GiB for u in used], color=color, lw=1, label=f"GPU {d}")
            for x in trace["ended"].get(d, []):
                ax.axvline(x, color=color, lw=0.6, ls=":", alpha=0.8)
        ax.axhline(total / GiB, color="black", ls="--", lw=0.8)
        if limit is not None:
            ax.axhline(limit / GiB, color="grey", ls=":", lw=0.8)
        ax.set_title(label, fontsize=9)
        ax.set_ylabel("GiB used")
        ax.set_xlabel("seconds")
        ax.set_ylim(0, total / GiB * 1.08)
    for ax in list(axes.flat)[n:]:
        ax.set_visible(False)
    axes.flat[0].legend(fontsize=7, loc="upper left")
    if title:
        fig.suptitle(title, fontsize=10)
    save(fig, path)


def lines(
    path: Path,
    x: Sequence[float],
    series: Mapping[str, Sequence[float]],
    *,
    xlabel: str,
    ylabel: str,
    title: str = "",
    logx: bool = False,
) -> None:
    """A simple line plot: one line per series, markers at the measured points."""
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, ys in series.items():
        ax.plot(x, ys, marker="o", label=name)
    if logx:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title, fontsize=10)
    save(fig, path)


def bars(
    path: Path,
    values: Mapping[str, float],
    *,
    ylabel: str,
    title: str = "",
    ymax: float | None = None,
) -> None:
    """One bar per figure, its value written on it."""
    fig, ax = plt.subplots(figsize=(6, 3.2))
    names = list(values)
    ax.bar(names, [values[n] for n in names], color=COLORS[0])
    for i, n in enumerate(names):
        ax.annotate(f"{values[n]:.3g}", (i, values[n]), ha="center", va="bottom", fontsize=8)
    ax.set_ylabel(ylabel)
    if ymax is not None:
        ax.set_ylim(0, ymax)
    ax.tick_params(axis="x", labelsize=8)
    if title:
        ax.set_title(title, fontsize=10)
    save(fig, path)
