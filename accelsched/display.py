"""What operators see: the ``accelsched status`` table, the Prometheus metrics and the
dashboard page, all drawn from accelsched's events and the scheduler's status snapshot.

**The status table**: what ``accelsched status`` shows and how it ends (the table, the
summary, the exit codes). The snapshot comes from the scheduler's read-only
``accelsched_status`` handler (:data:`~accelsched.protocol.STATUS_HANDLER`), asked
only once the scheduler's metadata says a PlacementPlugin serves
(:func:`~accelsched.protocol.placement_served`): that is how a cluster without the
PlacementPlugin is told apart from an empty one, without a request it would log with a
traceback. The dashboard page draws the same rows. The commands themselves, bounded in
time, are in :mod:`accelsched.cli`.

Exit codes (also in ``accelsched --help`` and docs/observe.md): :data:`OK`,
:data:`UNREACHABLE`, :data:`USAGE`, :data:`NO_ACCELSCHED`, and 130 after Ctrl-C before
an answer.

**Prometheus metrics**: distributed's scheduler serves ``prometheus_client``'s global
registry at ``/metrics`` when ``prometheus_client`` is installed (``pip install
"accelsched[metrics]"``), so these collectors appear there beside distributed's own. They
are fed from the PlacementPlugin's ``log_event`` hook, which sees every accelsched event
the scheduler logs, the workers' included: events stay the single source of truth.
Without ``prometheus_client`` they do nothing.

**The dashboard page** ``/accelsched``: built with Bokeh the way distributed builds its
own pages (a component with ``root`` and ``update``, refreshed by a periodic callback,
rendered in distributed's page template and theme), from the same snapshot as ``accelsched status``
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
import sys
from collections.abc import Callable, Mapping
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Final, cast

from dask.utils import format_bytes

from accelsched import events
from accelsched.events import shown
from accelsched.policy import timeouts
from accelsched.protocol import (
    PLACEMENT_PLUGIN,
    STATUS_HANDLER,
    DeviceStatus,
    StatusReply,
    placement_served,
)

if TYPE_CHECKING:
    from distributed import Client, Scheduler

__all__ = [
    "one_line",
    "shown",
    "snapshot",
    "ask_snapshot",
    "table_rows",
    "render",
    "summary",
    "COLUMNS",
    "waits_for",
    "count_event",
    "gpus_from",
    "stop_gpus",
    "install",
    "PAGE",
]

OK: Final = 0
#: The scheduler could not be reached within ``--timeout`` (nor its ``--scheduler-file``
#: read: missing or still empty), or went away under ``--watch``.
UNREACHABLE: Final = 1
#: Bad arguments (argparse's own code).
USAGE: Final = 2
#: The scheduler answers but runs no accelsched (no PlacementPlugin registered).
NO_ACCELSCHED: Final = 3
#: Its output could not be written (stdout closed, a full disk): sysexits' EX_IOERR.
OUTPUT_FAILED: Final = 74

EXIT_CODES_HELP: Final = (
    "exit codes: 0 ok (also Ctrl-C under --watch, or the reader of the output gone); "
    "1 scheduler unreachable or its scheduler file not there yet (or lost while watching); "
    "2 bad arguments; 3 the scheduler runs no accelsched (PlacementPlugin not registered); "
    "74 its output could not be written (stdout closed or full); 130 Ctrl-C before an answer"
)

#: The table's columns (field, heading), shared with the dashboard page. ``accelsched
#: status`` leaves POOL out while no worker is in an elastic pool (``accelsched.adapt``).
COLUMNS: Final = [
    ("worker", "WORKER"),
    ("pool", "POOL"),
    ("device", "GPU"),
    ("gpu", "NAME"),
    ("memory", "MEMORY"),
    ("capability", "CC"),
    ("declared", "DECLARED"),
    ("uuid", "UUID"),
    ("leases", "LEASES"),
    ("leak", "LEAK/THRESHOLD"),
    ("restarts", "RESTARTS"),
    ("leaks", "LEAKS"),
    ("reclaims", "RECLAIMED"),
    ("fallbacks", "FALLBACKS"),
    ("quarantine", "QUARANTINE"),
]


#: What a quarantined worker waits for, by the reason it was quarantined: its guard asks
#: for the restart again at each confirmed leak, and the restart proceeds once this holds.
WAITS_FOR: Final = {
    "no-peer": "a peer to take its data, or to hold and run nothing",
    "retire-failed": "a peer to take its data",
    "concurrency": "a free restart slot",
    "busy": "its running tasks to end",
    "restart-failed": "its nanny to restart it",
    "no-nanny": "a restart by hand (it has no nanny)",
    "restart-budget": "its restart window to move on",
}


def waits_for(reason: str) -> str | None:
    """What a worker quarantined for ``reason`` waits for (None: nothing known)."""
    return WAITS_FOR.get(reason.removeprefix("restart-deferred: ").split(":", 1)[0])


def quarantine_text(reason: str | None) -> str:
    """The QUARANTINE column: why, and what it waits for; ``-`` when not quarantined."""
    if not reason:
        return "-"
    return f"{reason}; waits for {wanted}" if (wanted := waits_for(reason)) else reason


def one_line(exc: BaseException) -> str:
    """An error as ``TypeName: detail`` on one line (an OSError by its ``strerror``): the
    detail may quote what a peer sent, so it is :func:`shown`."""
    raw = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    detail = shown(" ".join(raw.split()))
    return f"{type(exc).__name__}: {detail}" if detail else type(exc).__name__


def _bytes(nbytes: int | None) -> str:
    return "-" if nbytes is None else format_bytes(nbytes)


def table_rows(snap: StatusReply) -> dict[str, list[str]]:
    """Columns of text: one row per worker and verified GPU, one for a worker without."""
    rows = [
        {
            "worker": w["name"],
            "pool": w.get("pool") or "-",  # absent from an earlier accelsched
            "device": "-" if d is None else str(d["index"]),
            "gpu": "no verified GPU"
            if d is None
            else d["name"] + (" (withdrawn)" if d["withdrawn"] else ""),
            "memory": _bytes(None if d is None else d["memory"]),
            "capability": "-" if d is None else d.get("capability") or "?",
            "declared": _bytes((d.get("declared") or None) if d is not None else None),
            "uuid": "-" if d is None else d["uuid"],
            "leases": "-" if d is None or d["leases"] is None else str(d["leases"]),
            "leak": "-"
            if d is None
            # granted since the worker's last heartbeat: no figures yet (DeviceStatus)
            else "waiting for the first heartbeat"
            if d.get("figures") == "waiting"
            else f"{_bytes(None if d['leak_estimate'] is None else max(d['leak_estimate'], 0))}"
            f"/{_bytes(d['leak_threshold'])}",
            "restarts": str(w["restarts"]),
            "leaks": str(w["leaks"]),
            "reclaims": str(w["reclaims"]),
            "fallbacks": str(w["fallbacks"]),
            "quarantine": quarantine_text(w["quarantined"]),
        }
        for w in snap["workers"]
        for d in cast("list[DeviceStatus | None]", w["devices"] or [None])
    ]
    return {c: [row[c] for row in rows] for c, _ in COLUMNS}


def summary(snap: StatusReply) -> str:
    """One line: the cluster at a glance."""
    workers = snap["workers"]
    line = (
        f"{len(workers)} workers, {sum(len(w['devices']) for w in workers)} verified GPUs, "
        f"{sum(1 for w in workers if w['quarantined'])} quarantined; "
        f"{snap['restarts']} restarts, {snap['leaks']} leaks, {snap['reclaims']} reclaimed, "
        f"{snap['fallbacks']} fallbacks"
    )
    if waiting := snap.get("waiting"):  # a scheduler of an earlier accelsched has none
        line += (
            f"; {sum(waiting.values())} GPU tasks waiting ("
            + ", ".join(f"{n} {reason}" for reason, n in waiting.items())
            + ")"
        )
    if not snap["guard"]:
        line += " (no GuardPlugin registered: no GPU is verified)"
    return line


def render(snap: StatusReply) -> str:
    """The text ``accelsched status`` prints: a summary line, the options and the table, every cell
    :func:`shown` (names come from the cluster) before the widths are taken."""
    rows = {c: [shown(v) for v in cells] for c, cells in table_rows(snap).items()}
    columns = [(c, h) for c, h in COLUMNS if c != "pool" or set(rows[c]) - {"-"}]
    widths = {c: max([len(h)] + [len(v) for v in rows[c]]) for c, h in columns}
    # the PlacementPlugin's options in effect (``register``'s keywords, in seconds); a
    # scheduler of an earlier accelsched has none
    return "\n".join(
        [
            f"scheduler {shown(snap['scheduler'])}: {summary(snap)}",
            "options: not reported (an earlier accelsched)"
            if (options := snap.get("options")) is None
            else "options: " + ", ".join(f"{k}={shown(v)}" for k, v in options.items()),
            "  ".join(h.ljust(widths[c]) for c, h in columns).rstrip(),
            *(
                "  ".join(rows[c][i].ljust(widths[c]) for c, _ in columns).rstrip()
                for i in range(len(rows["worker"]))
            ),
        ]
    )


def snapshot(client: Client) -> StatusReply | None:
    """The scheduler's snapshot (what ``accelsched status --json`` prints), through a
    synchronous ``client``; None when the scheduler runs no accelsched."""
    return client.sync(ask_snapshot, client.scheduler)


async def ask_snapshot(scheduler: Any) -> StatusReply | None:
    """The snapshot from ``scheduler`` (an rpc to it); None when it runs no accelsched.
    Its metadata is asked first: it would log a request to a handler it lacks."""
    if await placement_served(scheduler) is False:
        return None
    return cast("StatusReply | None", await getattr(scheduler, STATUS_HANDLER)())


# --- Prometheus metrics ---------------------------------------------------------------


@lru_cache(maxsize=1)
def _collectors() -> dict[str, Any] | None:
    """Create the collectors once per process (the registry refuses duplicates)."""
    try:
        import prometheus_client as pc
    except ImportError:
        return None
    return {
        "events": pc.Counter(
            "accelsched_events", "accelsched events logged, by action", ["action"]
        ),
        "fallback_wait": pc.Histogram(
            "accelsched_fallback_wait_seconds",
            "Seconds a GPU task waited unplaced before its CPU form ran",
            ["reason"],
            buckets=(0.0, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 300, float("inf")),
        ),
        "leaked": pc.Histogram(
            "accelsched_leak_bytes",
            "Device bytes a confirmed leak held",
            buckets=tuple(2.0**k for k in range(20, 38, 2)) + (float("inf"),),
        ),
        "gpus": pc.Gauge("accelsched_gpus", "GPUs in the cluster, by state", ["state"]),
    }


def count_event(msg: Mapping[str, Any]) -> None:
    """Count one accelsched event.

    Any client may log to the ``accelsched`` topic: only known actions and reasons
    become labels (each label is a series held for the process's life) and only
    non-negative numbers are counted, so a forged event can neither raise here nor
    grow the registry.
    """
    c = _collectors()
    action = msg.get("action")
    if c is None or not isinstance(action, str) or action not in events.ACTIONS:
        return
    # a burst of fallbacks comes as one event with its size (``count``)
    count = _number(msg.get("count", 1)) if action == events.FALLBACK else 1
    c["events"].labels(action=action).inc(count if count is not None else 1)
    if action == events.FALLBACK:
        reason = r if isinstance(r := msg.get("reason"), str) and r in _REASONS else "other"
        c["fallback_wait"].labels(reason=reason).observe(_number(msg.get("waited", 0)) or 0)
    elif action == events.LEAK:
        c["leaked"].observe(_number(msg.get("nbytes", 0)) or 0)


#: The fallback reasons :mod:`accelsched.policy.timeouts` gives; any other is ``"other"``.
_REASONS = frozenset(
    {
        timeouts.TIMEOUT,
        timeouts.NO_GPU_CAPACITY,
        timeouts.UNSATISFIABLE,
        timeouts.CHAIN,
        timeouts.OOM,
    }
)


def _number(value: Any) -> float | None:
    """A finite, non-negative number from an event, or None (an int too large for a
    float, NaN and infinity compare outside the range)."""
    plain = isinstance(value, (int, float)) and not isinstance(value, bool)
    return float(value) if plain and 0 <= value <= sys.float_info.max else None


#: What the GPU gauge reads now (the registry is the process's: one source at a time).
_gauge_source: list[Callable[[], tuple[int, int]]] = []


def gpus_from(count: Callable[[], tuple[int, int]]) -> None:
    """Serve the GPU gauge from ``count()`` -> (verified, quarantined), read at scrape
    time: registering the 200th worker costs what registering the first did."""
    c = _collectors()
    if c is None:
        return
    _gauge_source[:] = [count]
    c["gpus"].labels(state="verified").set_function(lambda: count()[0])
    c["gpus"].labels(state="quarantined").set_function(lambda: count()[1])


def stop_gpus(count: Callable[[], tuple[int, int]]) -> None:
    """``count`` stops serving the gauge (its plugin was unregistered or its scheduler
    closed): the gauge reads 0 rather than a gone plugin's grants, and holds it no more.
    Nothing changes when another source took over since."""
    if _gauge_source == [count]:
        gpus_from(lambda: (0, 0))
        _gauge_source.clear()


# --- the dashboard page ---------------------------------------------------------------

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
    from accelsched import internals  # (loads distributed: the command line does not)

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
        self.estimates, self.thresholds, self.leak_marks, self.events, self.fallback_steps = (
            ColumnDataSource({f: [] for f in fields.split()}, name=f"accelsched-{name}")
            for name, fields in (
                ("estimates", "xs ys label color"),
                ("thresholds", "xs ys label color"),
                ("leak-marks", "x y label"),
                ("events", "x top label color"),
                ("fallback-steps", "x y"),
            )
        )

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
        # the history: estimates and thresholds, events, fallbacks until now
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
        steps = [(steps[0][0], 0), *steps] if steps else [(snap["time"] * 1000, 0)]
        steps.append((snap["time"] * 1000, steps[-1][1]))
        self.fallback_steps.data = {"x": [x for x, _ in steps], "y": [y for _, y in steps]}
