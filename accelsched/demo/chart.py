"""The demo's report: one standalone HTML page (bokeh, resources inline: it opens
offline) with the device memory of every worker over the run, and the leak, restart and
fallback events marked where and when they happened.

A worker's line breaks where its process changed (a restart): the old process's last
figure is not drawn across the gap, as if the memory were held while no process ran.
Fallbacks the scheduler decided together (one check moves every task whose timeout
passed) are one mark with their count beside it: drawn one by one they would lie on top
of each other. The chart takes the page's width."""

from __future__ import annotations

import html
import math
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from accelsched import events as ev
from accelsched.demo.memory import Sample

__all__ = [
    "DEFAULT_REPORT",
    "MARKED",
    "TOGETHER",
    "default_report",
    "lines",
    "marks",
    "report_path",
    "write_report",
]

DEFAULT_REPORT = "accelsched-demo.html"
MiB = 2**20

#: The actions the chart marks, and how: (marker, colour).
MARKED: dict[str, tuple[str, str]] = {
    ev.LEAK: ("x", "crimson"),
    ev.RESTART: ("inverted_triangle", "black"),
    ev.FALLBACK: ("triangle", "darkorange"),
}

#: Seconds within which fallbacks are one mark, with their count (one check's batch).
TOGETHER = 0.5
TOGETHER_SAYS = "; the first: "


def default_report() -> Path:
    """Where the report goes without ``--report``: the system's temporary folder, not the
    working directory, which is often a project's checkout (a stray file for git)."""
    return Path(tempfile.gettempdir()) / DEFAULT_REPORT


def report_path(value: str | Path) -> Path:
    """Where ``accelsched demo --report`` writes: a ``.html`` file in a folder that
    exists, or a folder that exists (the file is then ``accelsched-demo.html`` in it).
    Checked before the demo starts, so a typo costs no cluster run."""
    if not str(value).strip():  # (Path("") is the working directory)
        raise ValueError(f"invalid report path {str(value)!r}: expected a .html file or a folder")
    path = Path(value).expanduser()
    if path.is_dir():
        path = path / DEFAULT_REPORT
    if path.suffix.lower() not in (".html", ".htm"):
        raise ValueError(f"invalid report path {str(value)!r}: expected a .html file or a folder")
    if not path.parent.is_dir():
        missing = "is no folder" if path.parent.exists() else "does not exist"
        raise ValueError(f"invalid report path {str(value)!r}: {str(path.parent)!r} {missing}")
    existed = path.exists()  # (through a link: what it points to)
    target = path.resolve()  # what the check's open makes, if nothing was there
    if existed and not path.is_file():  # a FIFO would block the open below for ever
        raise ValueError(f"invalid report path {str(value)!r}: it is no regular file")
    try:  # writable? (a read-only or virtual folder would fail only after the whole run)
        with path.open("a"):
            pass
    except OSError as exc:
        raise ValueError(
            f"invalid report path {str(value)!r}: cannot write there ({exc.strerror})"
        ) from None
    if not existed:
        target.unlink(missing_ok=True)  # (a dangling link stays as it was)
    # as given, made absolute (a link named .html stays the path to write through: its
    # target may have any name, and checked again it would be refused)
    return path.absolute()


def lines(samples: Sequence[Sample]) -> dict[str, tuple[list[float], list[float]]]:
    """Per worker name, its line: times and MiB in time order, with a NaN point (a
    break, where bokeh lifts the pen) wherever the process changed."""
    out: dict[str, tuple[list[float], list[float]]] = {}
    last: dict[str, int] = {}
    for s in sorted(samples, key=lambda s: s.t):
        ts, mib = out.setdefault(s.worker, ([], []))
        if s.worker in last and last[s.worker] != s.process:
            ts.append((ts[-1] + s.t) / 2)
            mib.append(math.nan)
        last[s.worker] = s.process
        ts.append(s.t)
        mib.append(s.nbytes / MiB)
    return out


def marks(
    samples: Sequence[Sample],
    events: Iterable[tuple[float, Mapping[str, Any]]],
    names: Mapping[str, str],
    start: float,
) -> dict[str, dict[str, list[Any]]]:
    """Per marked action: when, which worker, at what height (the worker's memory in its
    latest sample at or before the event, the figure the event saw; 0 for
    scheduler-side fallbacks), how many events the mark stands for and what happened.
    Fallbacks within :data:`TOGETHER` seconds of a group's first are one mark."""
    out: dict[str, dict[str, list[Any]]] = {
        a: {"t": [], "mib": [], "worker": [], "what": [], "count": [], "label": []} for a in MARKED
    }
    ordered = sorted(samples, key=lambda s: s.t)
    for stamp, msg in sorted(events, key=lambda e: e[0]):
        action = msg.get("action")
        if action not in MARKED:
            continue
        t = stamp - start
        col = out[action]
        what = ev.describe(msg, names)
        if action == ev.FALLBACK and col["t"] and t - col["t"][-1] <= TOGETHER:
            n = col["count"][-1] = col["count"][-1] + 1
            col["label"][-1] = f" {n}"
            first = col["what"][-1].split(TOGETHER_SAYS, 1)[-1]
            col["what"][-1] = f"{n} tasks fell back within {TOGETHER:g} s{TOGETHER_SAYS}{first}"
            continue
        addr = msg.get("worker")
        worker = names.get(addr, addr) if addr else "scheduler"
        before = [s.nbytes for s in ordered if s.worker == worker and s.t <= t]
        col["t"].append(t)
        col["mib"].append(before[-1] / MiB if before else 0.0)
        col["worker"].append(worker)
        col["what"].append(what)
        col["count"].append(1)
        col["label"].append("")
    return out


def write_report(
    path: Path,
    samples: Sequence[Sample],
    events: Iterable[tuple[float, Mapping[str, Any]]],
    names: Mapping[str, str],
    start: float,
    note: str,
    stages: Sequence[tuple[float, str]] = (),
) -> Path:
    """Draw the chart and write the page; return its path. ``start``: the time stamp the
    chart's 0 is. ``stages``: when each stage began (time stamps) and its name, in
    order, drawn as numbered dotted lines (those that began before ``start`` are listed,
    not drawn)."""
    from bokeh.embed import file_html
    from bokeh.layouts import column
    from bokeh.models import ColumnDataSource, HoverTool
    from bokeh.models.annotations import Label, Span
    from bokeh.models.ranges import DataRange1d
    from bokeh.models.renderers import DataRenderer
    from bokeh.models.widgets import Div
    from bokeh.palettes import Category10_10
    from bokeh.plotting import figure
    from bokeh.resources import INLINE

    fig = figure(
        title="Device memory held by each worker process (NVML, per process)",
        x_axis_label="seconds since the cluster was up",
        y_axis_label="device memory (MiB)",
        sizing_mode="stretch_width",  # the page's width, whatever the window
        height=460,
        name="device-memory",
        tools="pan,wheel_zoom,box_zoom,reset,save",
        x_range=DataRange1d(start=0),  # from the cluster's being up, where ``start`` is
    )
    for i, (worker, (ts, mib)) in enumerate(sorted(lines(samples).items())):
        source = ColumnDataSource({"t": ts, "mib": mib, "worker": [worker] * len(ts)})
        colour = Category10_10[i % 10]
        fig.step(
            "t",
            "mib",
            source=source,
            mode="after",
            color=colour,
            legend_label=worker,
            name=f"memory {worker}",
        )
        fig.scatter("t", "mib", source=source, size=3, color=colour, legend_label=worker)
    hover: list[DataRenderer] = []
    for action, cols in marks(samples, events, names, start).items():
        if not cols["t"]:
            continue
        marker, colour = MARKED[action]
        source = ColumnDataSource({**cols, "action": [action] * len(cols["t"])})
        hover.append(
            fig.scatter(
                "t",
                "mib",
                source=source,
                marker=marker,
                size=14,
                line_width=2,
                color=colour,
                fill_alpha=0.2,
                legend_label=action,
            )
        )
        if any(cols["label"]):  # how many events the mark stands for
            fig.text(
                "t",
                "mib",
                text="label",
                source=source,
                x_offset=9,
                y_offset=-4,
                text_color=colour,
                text_font_style="bold",
                text_font_size="13px",
            )
    fig.add_tools(
        HoverTool(renderers=hover, tooltips=[("", "@action: @what"), ("at", "@t{0.00} s")])
    )
    for number, (began, _) in enumerate(stages, 1):
        t = began - start
        if t < 0:  # the cluster's start-up, before the timeline begins
            continue
        fig.add_layout(Span(location=t, dimension="height", line_dash="dotted", line_color="gray"))
        fig.add_layout(Label(x=t, y=4, x_units="data", y_units="screen", text=f" {number}"))
    fig.legend.location = "top_left"
    fig.legend.click_policy = "hide"
    listed = "".join(f"<li>{html.escape(name)}</li>" for _, name in stages)
    text = f"<h2>accelsched demo</h2><p>{html.escape(note)}</p>"
    if listed:
        text += f"<p>Stages (dotted lines, numbered at the bottom):</p><ol>{listed}</ol>"
    page = column(Div(text=text), fig, sizing_mode="stretch_width")
    path.write_text(file_html(page, INLINE, "accelsched demo"), encoding="utf-8")
    return path
