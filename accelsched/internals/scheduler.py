"""The scheduler's state: plugins, GPU resources, unrunnable tasks, lossless restarts,
the guards' heartbeat figures and the dashboard page."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable, Collection, Iterator, Mapping
from time import monotonic, time
from typing import TYPE_CHECKING, Any

from distributed.core import Status
from distributed.protocol import pickle

from accelsched.protocol import GPU, GPU_MEMORY

if TYPE_CHECKING:
    from distributed import Scheduler
    from distributed.scheduler import TaskState, WorkerState

ORIGINAL = "__accelsched_original__"

# --- scheduler: plugins -----------------------------------------------------------------


def notify_unregistered(scheduler: Scheduler) -> None:
    """Close a scheduler plugin that has an ``unregistered()`` hook when a client
    unregisters it, then call the hook (distributed calls none then: not even ``close``)."""

    async def unregister(original: Callable[..., Any], name: str) -> None:
        plugin = scheduler.plugins.get(name)
        await original(name=name)
        if plugin is not None and callable(hook := getattr(plugin, "unregistered", None)):
            await plugin.close()
            hook()

    wrap_handler(scheduler, "unregister_scheduler_plugin", unregister)


def last_started(scheduler: Scheduler, name: str, plugin: Any) -> Any:
    """The plugin that started as ``name`` on ``scheduler`` before ``plugin`` (None: none
    did), noting ``plugin`` as the one started now. Kept on the scheduler, so a plugin
    unregistered (which nothing else holds) can still hand on what it decided, and both
    go with the scheduler."""
    started = scheduler.__dict__.setdefault("_accelsched_started", {})
    previous, started[name] = started.get(name), plugin
    return previous


def restore_handler(scheduler: Scheduler, name: str) -> None:
    """Undo :func:`wrap_handler`: distributed's own handler ``name`` again."""
    handler = scheduler.handlers[name]
    scheduler.handlers[name] = getattr(handler, ORIGINAL, handler)


def worker_plugin_registered(scheduler: Scheduler, name: str) -> bool:
    return name in scheduler.worker_plugins


# --- scheduler: GPU resources -----------------------------------------------------------


def wrap_handler(scheduler: Scheduler, name: str, handler: Callable[..., Any]) -> None:
    """Route distributed's handler ``name`` (``set_resources``, ``set_restrictions``:
    what any client may call) through ``handler(original, **message)``. Wraps
    distributed's own handler, never a previous wrapper."""
    original = scheduler.handlers[name]
    original = getattr(original, ORIGINAL, original)

    def wrapped(**message: Any) -> Any:
        return handler(original, **message)

    setattr(wrapped, ORIGINAL, original)
    scheduler.handlers[name] = wrapped


def apply_resources(
    original: Callable[..., Any], scheduler: Scheduler, worker: str, resources: dict
) -> Any:
    """Call distributed's ``set_resources``, keeping what running tasks use.

    ``Scheduler.add_resources`` zeroes ``used_resources``; tasks already processing on
    the worker still hold theirs, and releasing them later would go negative.
    """
    ws = scheduler.workers.get(worker)
    used = dict(ws.used_resources) if ws is not None else {}
    result = original(worker=worker, resources=resources)
    if ws is not None:
        ws.used_resources.update({r: q for r, q in used.items() if r in ws.used_resources})
    return result


def set_worker_gpus(scheduler: Scheduler, ws: WorkerState, count: float, name: str = GPU) -> None:
    """The amount of resource ``name`` (the GPU count by default) the scheduler places
    against for ``ws``, keeping what tasks use."""
    ws.resources[name] = count
    ws.used_resources.setdefault(name, 0)
    scheduler.resources.setdefault(name, {})[ws.address] = count


def share_worker_restriction(ts: TaskState, workers: set[str] | None) -> None:
    """Place ``ts`` only on ``workers`` (None: anywhere), the very set, not a copy:
    whoever holds it changes the restriction of every task sharing it. distributed reads
    a task's ``worker_restrictions`` and replaces it, never edits it in place."""
    ts.worker_restrictions = workers
    ts.loose_restrictions = False


def restricted_to(ts: TaskState) -> set[str]:
    """The workers ``ts`` is restricted to (empty: none named)."""
    return set(ts.worker_restrictions or ())


def take_restricted_hosts(scheduler: Scheduler, ts: TaskState) -> set[str]:
    """The hosts ``ts`` is restricted to (``workers=["hostname"]``), by the names the
    scheduler knows them by; taken off the task. distributed places a task on the union
    of its worker and host restrictions: left on, a host would widen the worker
    restriction that says which workers meet the task's requirement."""
    hosts = {scheduler.coerce_hostname(h) for h in ts.host_restrictions or ()}
    ts.host_restrictions = None
    return hosts


def restrict_to_own(ts: TaskState, own: Collection[str] | None) -> None:
    """Give ``ts`` back its own restriction (None: anywhere): the worker addresses and
    the hosts :func:`take_restricted_hosts` took, each where distributed keeps them."""
    own = own or ()
    ts.worker_restrictions = {o for o in own if "://" in o} or None
    ts.host_restrictions = {o for o in own if "://" not in o} or None
    ts.loose_restrictions = False


def largest_gpu_count(scheduler: Scheduler) -> float:
    """The most GPUs any one worker offers now (what one task could be placed against)."""
    return max(scheduler.resources.get(GPU, {}).values(), default=0)


# --- scheduler: tasks ------------------------------------------------------------------


def unrunnable(scheduler: Scheduler) -> Mapping[TaskState, float]:
    """Tasks in ``no-worker`` and the (monotonic) time each became unrunnable."""
    return scheduler.unrunnable


def task_spec(ts: TaskState) -> Any:
    """The task's run spec as the scheduler unpickled it (functions included)."""
    return ts.run_spec


def harden_restrictions(ts: TaskState) -> None:
    """Drop a task's soft worker preference (``allow_other_workers``): a GPU task placed
    on a GPU-less worker raises in its ``acquire_resources`` and wedges."""
    if ts.loose_restrictions:
        ts.loose_restrictions = False
        ts.worker_restrictions = ts.host_restrictions = None


def set_resource_restrictions(ts: TaskState, restrictions: dict[str, float]) -> None:
    """Edit a task's resource restrictions (safe while it is released or unrunnable)."""
    ts.resource_restrictions = restrictions


def annotate(ts: TaskState, name: str, value: Any) -> None:
    """Add an annotation the worker receives with the task."""
    ts.annotations = {**(ts.annotations or {}), name: value}


def drop_annotated_resource(ts: TaskState, name: str) -> None:
    """Remove ``name`` from the task's ``resources`` annotation (sent to the worker as is)."""
    annotations = ts.annotations or {}
    resources = annotations.get("resources")
    if isinstance(resources, dict) and name in resources:
        ts.annotations = {
            **annotations,
            "resources": {k: v for k, v in resources.items() if k != name},
        }


def run_now(scheduler: Scheduler, keys: list[Any], stimulus_id: str) -> None:
    """Send unrunnable tasks (whose restrictions now allow it) to a worker."""
    if keys:
        scheduler.transitions(dict.fromkeys(keys, "processing"), stimulus_id=stimulus_id)


def fail_task(scheduler: Scheduler, key: Any, exc: BaseException, stimulus_id: str) -> None:
    """Err a task with ``exc`` (the client sees it as the task's exception)."""
    recs = scheduler.transition(
        key, "erred", exception=pickle.dumps(exc), cause=key, stimulus_id=stimulus_id
    )
    scheduler.transitions(recs, stimulus_id=stimulus_id)


def release_unfit(scheduler: Scheduler, ws: WorkerState) -> int:
    """Send back the tasks queued on ``ws`` that need more GPUs, or more declared
    device memory (MiB), than it offers now.

    The worker's state machine would hold them forever (and block its other GPU tasks
    behind them); released, the scheduler places them again against the new counts.
    The ones it runs now (``ws.executing``, as its last heartbeat said) run on: they
    hold their lease already. Returns how many went back.
    """
    offered = (ws.resources.get(GPU, 0), ws.resources.get(GPU_MEMORY, 0))
    unfit = [
        ts.key
        for ts in ws.processing
        if (need := ts.resource_restrictions or {})
        and (need.get(GPU, 0) > offered[0] or need.get(GPU_MEMORY, 0) > offered[1])
        and ts not in ws.executing
    ]
    if unfit:
        scheduler.transitions(
            dict.fromkeys(unfit, "released"), stimulus_id=f"accelsched-gpu-withdrawn-{time()}"
        )
    return len(unfit)


def ready_tasks(scheduler: Scheduler) -> Iterator[tuple[TaskState, float]]:
    """Every task ready to run or running: queued, unrunnable (``no-worker``), and
    processing on a worker (what elastic pools size themselves by), each with how long
    it is expected to run: its prefix's average, as distributed's own occupancy and
    adaptive target reckon it."""
    processing = (ts for ws in scheduler.workers.values() for ts in ws.processing)
    for ts in itertools.chain(getattr(scheduler, "queued", ()), scheduler.unrunnable, processing):
        yield ts, float(scheduler._get_prefix_duration(ts.prefix))


def busy(ws: WorkerState) -> tuple[bool, bool]:
    """Whether ``ws`` has tasks processing (running or queued there), and GPU tasks among
    them. Read from the tasks, not ``used_resources``: distributed's work stealing moves a
    task without moving what it holds there, so after a GPU task moved between workers
    (what accelsched's restarts and joins ask for) the figures of both are off."""
    return bool(ws.processing), any(
        GPU in r or GPU_MEMORY in r for ts in ws.processing if (r := ts.resource_restrictions)
    )


def offer_unrunnable(scheduler: Scheduler, ws: WorkerState) -> None:
    """Offer ``no-worker`` tasks to ``ws`` (``add_resources`` does not)."""
    recs = scheduler.bulk_schedule_unrunnable_after_adding_worker(ws)
    if recs:
        scheduler.transitions(recs, stimulus_id=f"accelsched-gpu-verified-{time()}")


# --- scheduler: restarts ----------------------------------------------------------------
# The scheduler's side of a lossless restart: drain, retire (copy the keys away), check,
# restart through the nanny, wait until the old process has left.
#
# Each step is distributed's own (``handle_worker_status_change``, ``retire_workers``,
# ``restart_workers``); only their order is accelsched's, because only that order loses
# nothing: ``Worker.close_gracefully(restart=True)`` does not check that the retirement
# worked. One departure: ``retire_workers`` checks whether the worker's keys were copied
# every ``len(has_what) / 400`` seconds, up to 0.5 s, so a worker holding a few hundred
# results waits half a second after its last key was copied. :func:`replace_worker` watches
# the same condition (every key the worker holds has another copy) every 10 ms itself and
# goes on as soon as it holds; the retirement ends in the background.

#: How often the retirement is watched (seconds).
RETIRE_POLL = 0.01
#: False: wait for ``retire_workers`` to return, as before (the restart benchmark's
#: "before" arm sets it; nothing else does).
WATCH_RETIREMENT = True


def closing(ws: WorkerState) -> bool:
    """Whether the worker is closing or closed: no longer one to ask anything (one that
    retires, ``closing_gracefully``, still answers, and may come back)."""
    return ws.status in (Status.closing, Status.closed, Status.failed)


def retiring(ws: WorkerState) -> bool:
    """Whether the worker was retired and still runs (``closing_gracefully``): it takes
    no new task, finishes those it runs, and keeps its results until they are moved."""
    return ws.status == Status.closing_gracefully


def in_service(ws: WorkerState) -> bool:
    """Whether the worker takes tasks, and results moved off a retiring peer."""
    return ws.status == Status.running


def holds_results(ws: WorkerState) -> bool:
    return bool(ws.has_what)


def has_running_peer(scheduler: Scheduler, ws: WorkerState) -> bool:
    return any(w is not ws for w in scheduler.running)


def idle_and_empty(ws: WorkerState) -> bool:
    """``ws`` holds no key and has no task: a restart of it loses nothing, peer or not."""
    return not ws.has_what and not ws.processing


def _holds_sole_copy(ws: WorkerState) -> bool:
    return any(len(ts.who_has or ()) < 2 for ts in ws.has_what)


async def replace_worker(
    scheduler: Scheduler,
    ws: WorkerState,
    stimulus_id: str,
    *,
    tell_draining: Callable[[bool], Awaitable[None]],
    lock: asyncio.Lock,
    drain_timeout: float,
    gone_timeout: float,
) -> dict[str, int] | str | None:
    """Drain, retire, check, restart ``ws`` through its nanny.

    Returns the figures of a restart that happened (``moved``: keys copied away,
    ``assigned``: tasks it had then), the reason it was given up (``busy``, ``no-peer``,
    ``retire-failed``, ``restart-failed: ...``; the worker stays drained, see
    :func:`resume`), or None when it left meanwhile. ``lock`` retires and kills one worker
    at a time: while a retired worker is still registered, another retirement could drop
    the only other copy of its keys ("the retired worker still has it").
    """
    if scheduler.workers.get(ws.address) is not ws:
        return None  # it left (or another process took its address) meanwhile
    # no new tasks for it (the scheduler's side only: what it runs finishes there)
    scheduler.handle_worker_status_change(Status.closing_gracefully, ws, stimulus_id)
    assigned = len(ws.processing)
    await tell_draining(True)  # its guard sends GPU tasks back as they reach execution
    # what has not started moves to the least busy peer that may run it. Without work
    # stealing, the guard sends the tasks back one by one as they reach execution
    # instead; a drained worker would otherwise work through its whole queue, each task
    # bounced through its thread pool (``Reschedule``): a second or more for a thousand
    for ts in list(ws.processing):
        valid = scheduler.valid_workers(ts)
        peers = [w for w in (scheduler.running if valid is None else valid) if w is not ws]
        if peers:
            _steal(scheduler, ts, ws, min(peers, key=lambda w: len(w.processing)))
    deadline = monotonic() + drain_timeout
    while ws.processing and monotonic() < deadline:
        await asyncio.sleep(0.05)
    if ws.processing:
        return "busy"
    async with lock:
        if scheduler.workers.get(ws.address) is not ws:
            return None
        moved = len(ws.has_what)
        if not await _retire(scheduler, ws, stimulus_id):
            return "no-peer"
        if _holds_sole_copy(ws):
            return "retire-failed"
        # its copies forgotten now, in the same step as the check: the other copy of
        # each key is then its last, which distributed's memory manager never drops.
        # Until the worker is gone it would drop one of the two, from a worker not
        # running first: a peer draining for its own restart, or paused, loses its copy
        # as readily as this retired one, and the key would go with this worker
        if keys := [ts.key for ts in ws.has_what]:
            scheduler.request_remove_replicas(ws.address, keys, stimulus_id=stimulus_id)
        result = await scheduler.restart_workers(
            [ws.address], wait_for_workers=False, on_error="return", stimulus_id=stimulus_id
        )
        if (said := str(result.get(ws.address))) != "OK":
            return f"restart-failed: {said}"
        deadline = monotonic() + gone_timeout  # gone from who_has before the next retirement
        while scheduler.workers.get(ws.address) is ws and monotonic() < deadline:
            await asyncio.sleep(0.01)
    return {"moved": moved, "assigned": assigned}


async def _retire(scheduler: Scheduler, ws: WorkerState, stimulus_id: str) -> bool:
    """Copy ``ws``'s unique keys to peers, keeping it registered; True when it worked."""
    outcome: list[bool | Exception] = []

    async def retirement() -> None:
        try:
            retired = await scheduler.retire_workers(
                workers=[ws.address], close_workers=False, remove=False, stimulus_id=stimulus_id
            )
            outcome.append(ws.address in retired)
        except Exception as exc:
            outcome.append(exc)

    scheduler._ongoing_background_tasks.call_soon(retirement)
    await asyncio.sleep(0)  # retire_workers marked it retiring and kicked the memory manager
    while not outcome:
        # it is still the registered one, and every key it holds has another copy
        if (
            WATCH_RETIREMENT
            and scheduler.workers.get(ws.address) is ws
            and not _holds_sole_copy(ws)
        ):
            return True
        await asyncio.sleep(RETIRE_POLL)
    if isinstance(outcome[0], Exception):
        raise outcome[0]
    return outcome[0]


def resume(scheduler: Scheduler, ws: WorkerState, previous: Status, stimulus_id: str) -> None:
    """Undo a drain that was given up: back to ``previous`` on both sides.

    A worker its memory monitor had paused stays paused (the monitor unpauses it when its
    memory allows). A failed retirement tells the worker it is closing gracefully, so the
    worker is told too; only a worker still registered under the same state is touched.
    """
    if scheduler.workers.get(ws.address) is not ws:
        return
    if previous not in (Status.running, Status.paused):
        previous = Status.running
    scheduler.stream_comms[ws.address].send(
        {"op": "worker-status-change", "status": previous.name, "stimulus_id": stimulus_id}
    )
    scheduler.handle_worker_status_change(previous, ws, stimulus_id)


def _steal(scheduler: Scheduler, ts: Any, victim: WorkerState, thief: WorkerState) -> bool:
    """Ask ``victim`` to hand the queued task ``ts`` to ``thief``, by distributed's work
    stealing protocol: the worker gives a task up only if it has not started it, so
    nothing runs twice. False when no request went out."""
    stealing = scheduler.extensions.get("stealing")  # None: work stealing is off
    return stealing is not None and stealing.move_task_request(ts, victim, thief) not in (
        "in-flight",
        "comm-closed",
    )


def take_share(scheduler: Scheduler, ws: WorkerState) -> int:
    """``ws`` just offered GPUs (a new or restarted worker): take its share of the tasks
    queued on its peers, by the same protocol. distributed sends every GPU task to a
    valid worker at submission, so a worker joining later (a restarted one, whose queue
    went to its peer) would otherwise idle until work stealing evens the queues out,
    slowly for short tasks. Returns the requests sent."""
    peers = [w for w in scheduler.running if w is not ws]
    if ws not in scheduler.running or not peers:
        return 0
    fair = sum(len(w.processing) for w in (*peers, ws)) // (len(peers) + 1)
    sent = 0
    for victim in peers:
        excess = len(victim.processing) - fair
        for ts in list(victim.processing):
            if excess <= 1:
                break
            valid = scheduler.valid_workers(ts)
            if (valid is None or ws in valid) and _steal(scheduler, ts, victim, ws):
                sent += 1
                excess -= 1
    return sent


# --- scheduler: what operators see ------------------------------------------------------


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
