"""The accelsched page on the scheduler's Dask dashboard: ``/accelsched``.

Built with Bokeh the way distributed builds its own pages (a component with ``root`` and
``update``, refreshed by a periodic callback, rendered in distributed's page template and
theme), from the same snapshot as ``accelsched status``
(:class:`~accelsched.scheduler.grants.StatusHistory`):

- a table, one row per worker and verified GPU: name, memory, UUID, leases in use, leak
  estimate against its threshold, restarts, leaks, reclaimed leaks, fallbacks, quarantine;
- the leak estimate of each device over time, its threshold dashed, leaks marked ``x``
  and restarts, quarantines and unhealthy devices as vertical lines;
- fallbacks over time (cumulative).

distributed builds its dashboard before any plugin starts, so :func:`install` adds the
page to the running dashboard (:func:`accelsched.internals.add_dashboard_page`). The
PlacementPlugin's ``start`` calls it, whether a client registered the plugin or a
preload installed it; calling it again does nothing. The page finds whichever
PlacementPlugin is registered when it is drawn, so a re-registered plugin is shown.
"""

from __future__ import annotations

import html
from typing import TYPE_CHECKING, Any

from accelsched import internals
from accelsched.display.status_table import COLUMNS, summary, table_rows
from accelsched.protocol import PLACEMENT_PLUGIN

if TYPE_CHECKING:
    from distributed import Scheduler

__all__ = ["install", "PAGE"]

#: The page's path under the dashboard's prefix, and its tab's label.
PAGE = "accelsched"
#: How often an open page redraws (ms); the status history samples once a second.
REFRESH_MS = 1000
MiB = 2**20
#: Table headings and widths where the CLI's capitals do not read well.
TITLES = {"device": "GPU", "gpu": "Name", "uuid": "UUID", "leak": "Leak / threshold"}
WIDTHS = {"worker": 120, "gpu": 180, "uuid": 330, "leak": 130, "quarantine": 160}


def install(scheduler: Scheduler) -> bool:
    """Add the page to the scheduler's dashboard; False when it runs without one."""
    return internals.add_dashboard_page(scheduler, PAGE, Page, refresh_ms=REFRESH_MS)


def status_history_of(scheduler: Scheduler) -> Any:
    """The registered PlacementPlugin's :class:`~accelsched.scheduler.grants.StatusHistory`
    (None when accelsched is unregistered); read, not imported: the page sits below it."""
    history = getattr(scheduler.plugins.get(PLACEMENT_PLUGIN), "status_history", None)
    return history if getattr(history, "scheduler", None) is scheduler else None


class Page:
    """One browser session's page, in distributed's ``DashboardComponent`` shape: ``root``
    and ``update()``."""

    def __init__(self, scheduler: Scheduler) -> None:
        from bokeh.layouts import column
        from bokeh.models import ColumnDataSource, HoverTool
        from bokeh.models.widgets import DataTable, Div, TableColumn
        from bokeh.palettes import Category10_10
        from bokeh.plotting import figure

        self.scheduler = scheduler
        self.palette = list(Category10_10)
        self.summary = Div(text="", sizing_mode="stretch_width")
        self.rows = ColumnDataSource({c: [] for c, _ in COLUMNS}, name="accelsched-rows")
        self.table = DataTable(
            source=self.rows,
            columns=[
                TableColumn(field=c, title=TITLES.get(c, t.capitalize()), width=WIDTHS.get(c, 70))
                for c, t in COLUMNS
            ],
            index_position=None,
            height=32 + 26,  # a heading and a row, as update() sizes it
            sizing_mode="stretch_width",
        )
        self.estimates = ColumnDataSource(
            {"xs": [], "ys": [], "label": [], "color": []}, name="accelsched-estimates"
        )
        self.thresholds = ColumnDataSource(
            {"xs": [], "ys": [], "label": [], "color": []}, name="accelsched-thresholds"
        )
        self.leak_marks = ColumnDataSource(
            {"x": [], "y": [], "label": []}, name="accelsched-leak-marks"
        )
        self.events = ColumnDataSource(
            {"x": [], "top": [], "label": [], "color": []}, name="accelsched-events"
        )
        self.fallback_steps = ColumnDataSource({"x": [], "y": []}, name="accelsched-fallback-steps")

        self.leak_figure = figure(
            title="Leak estimate per worker and GPU (MiB), threshold dashed",
            x_axis_type="datetime",
            y_axis_label="MiB",
            height=300,
            sizing_mode="stretch_width",
            tools="pan,wheel_zoom,box_zoom,reset",
        )
        est = self.leak_figure.multi_line(
            "xs", "ys", color="color", line_width=2, source=self.estimates, legend_field="label"
        )
        self.leak_figure.multi_line(
            "xs", "ys", color="color", line_dash="dashed", source=self.thresholds
        )
        self.leak_figure.segment(
            "x", 0, "x", "top", color="color", line_width=2, source=self.events
        )
        self.leak_figure.scatter(
            "x", "y", marker="x", size=14, color="red", line_width=3, source=self.leak_marks
        )
        self.leak_figure.add_tools(HoverTool(renderers=[est], tooltips=[("", "@label")]))

        self.fallback_figure = figure(
            title="Fallbacks to CPU (cumulative)",
            x_axis_type="datetime",
            x_range=self.leak_figure.x_range,
            height=200,
            sizing_mode="stretch_width",
            tools="pan,wheel_zoom,box_zoom,reset",
        )
        self.fallback_figure.step("x", "y", mode="after", line_width=2, source=self.fallback_steps)
        self.root = column(
            self.summary,
            self.table,
            self.leak_figure,
            self.fallback_figure,
            sizing_mode="stretch_width",
        )

    def update(self) -> None:
        history = status_history_of(self.scheduler)
        if history is None:
            self.summary.text = "<b>accelsched is not registered on this scheduler.</b>"
            return
        snap = history.snapshot()
        self.summary.text = f"<b>accelsched</b>: {html.escape(summary(snap))}"
        self.rows.data = table_rows(snap)
        self.table.height = 32 + 26 * max(len(self.rows.data["worker"]), 1)
        self._draw_history(history, snap["time"])

    def _draw_history(self, history: Any, now: float) -> None:
        series = sorted(history.series.items())
        lines = [
            [
                [(s.time * 1000, max(s.estimate, 0) / MiB) for s in ss if s.estimate is not None]
                for _, ss in series
            ],
            [
                [(s.time * 1000, s.threshold / MiB) for s in ss if s.threshold is not None]
                for _, ss in series
            ],
        ]
        for source, points in zip((self.estimates, self.thresholds), lines, strict=True):
            source.data = {
                "xs": [[x for x, _ in pts] for pts in points],
                "ys": [[y for _, y in pts] for pts in points],
                "label": [f"{name} GPU {device}" for (name, device), _ in series],
                "color": [self.palette[i % len(self.palette)] for i in range(len(series))],
            }
        # a leak is marked where its estimate was; every other event is a line to the top
        leaks = [m for m in history.markers if m.action == "leak" and m.nbytes is not None]
        others = [m for m in history.markers if m.action != "leak" or m.nbytes is None]
        top = max(
            [1.0]
            + [m.nbytes / MiB for m in history.markers if m.nbytes is not None]
            + [y for points in lines for pts in points for _, y in pts]
        )
        self.leak_marks.data = {
            "x": [m.time * 1000 for m in leaks],
            "y": [m.nbytes / MiB for m in leaks if m.nbytes is not None],
            "label": [f"{m.action} {m.worker or ''}".strip() + f" GPU {m.device}" for m in leaks],
        }
        self.events.data = {
            "x": [m.time * 1000 for m in others],
            "top": [top] * len(others),
            "label": [f"{m.action} {m.worker or ''}".strip() for m in others],
            "color": ["black" if m.action == "restart" else "orange" for m in others],
        }
        steps = [(t * 1000, n) for t, n in history.fallbacks]
        steps = [(steps[0][0], 0), *steps] if steps else [(now * 1000, 0)]
        steps.append((now * 1000, steps[-1][1]))
        self.fallback_steps.data = {"x": [x for x, _ in steps], "y": [y for _, y in steps]}
