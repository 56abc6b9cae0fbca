"""Custom heartbeat metrics and a page on the scheduler's dashboard: how accelsched's state
reaches the scheduler and is shown there."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from distributed import Scheduler, Worker
    from distributed.scheduler import WorkerState


def add_metric(worker: Worker, name: str, fn: Callable[[Any], Any]) -> None:
    """Send ``fn(worker)`` with every heartbeat under ``name`` (a custom worker metric:
    ``Worker.metrics`` is read at each heartbeat, so one added later still travels).

    The dict is replaced, never changed in place: ``Worker.get_metrics`` awaits between
    its items, so a guard set up during a heartbeat would change it mid-iteration
    (``RuntimeError: dictionary changed size during iteration``).
    """
    worker.metrics = {**worker.metrics, name: fn}


def remove_metric(worker: Worker, name: str, fn: Callable[[Any], Any]) -> None:
    """Stop sending ``name``, if it is still ``fn`` (not a newer guard's)."""
    if worker.metrics.get(name) == fn:
        worker.metrics = {k: v for k, v in worker.metrics.items() if k != name}


def worker_metric(ws: WorkerState, name: str) -> Any:
    """The latest value of a custom metric a worker's heartbeat carried (None before the
    first heartbeat that had it)."""
    return (ws.metrics or {}).get(name)


def add_dashboard_page(
    scheduler: Scheduler, page: str, component: Callable[[Scheduler], Any], *, refresh_ms: int
) -> bool:
    """Serve ``/<page>`` on the scheduler's running dashboard, with a tab on every page:
    each browser session gets a new ``component(scheduler)`` (distributed's
    ``DashboardComponent`` shape: ``root`` and ``update()``), updated every ``refresh_ms``,
    in distributed's own template (the tabs) and theme, as its own pages are (no public API
    has them).

    distributed builds its Bokeh pages once, in ``Scheduler.__init__``, from a fixed
    table; a plugin starts later. So this adds a second Bokeh server application to the
    dashboard's router, as ``distributed.dashboard.scheduler.connect`` does for the first,
    and puts the page in the navigation its templates share. Idempotent; False when the
    scheduler runs no dashboard.
    """
    try:
        from bokeh.server.server import BokehTornado
        from distributed.dashboard.core import BokehApplication
        from distributed.dashboard.scheduler import template_variables
    except ImportError:  # no bokeh, or one distributed cannot use: no dashboard
        return False
    from tornado.ioloop import IOLoop

    router = getattr(scheduler, "http_application", None)
    apps = [a for a in getattr(router, "applications", ()) if isinstance(a, BokehTornado)]
    if router is None or not apps:
        return False
    path = "/" + page
    if any(path in app.app_paths for app in apps):
        return True
    variables = template_variables(scheduler)  # memoized: the dict every page renders
    if page not in variables["pages"]:
        variables["pages"].append(page)

    def make_doc(scheduler: Scheduler, extra: dict, doc: Any) -> None:
        from distributed.dashboard.components import add_periodic_callback
        from distributed.dashboard.components.scheduler import BOKEH_THEME, env

        shown = component(scheduler)
        shown.update()
        doc.title = f"Dask: {page}"
        doc.add_root(shown.root)
        add_periodic_callback(doc, shown, refresh_ms)
        doc.template = env.get_template("simple.html")
        doc.template_variables.update(extra)
        doc.theme = BOKEH_THEME

    app = BokehApplication(
        {path: make_doc}, scheduler, prefix=apps[0].prefix, template_variables=variables
    )
    router.add_application(app)
    app.initialize(IOLoop.current())
    app.start()
    return True
