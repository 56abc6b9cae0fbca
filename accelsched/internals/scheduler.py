"""The scheduler's state: plugins, GPU resources, unrunnable tasks."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Mapping
from time import time
from typing import TYPE_CHECKING, Any

from distributed.protocol import pickle

from accelsched.protocol import GPU, GPU_MEMORY

if TYPE_CHECKING:
    from distributed import Scheduler
    from distributed.scheduler import TaskState, WorkerState

ORIGINAL = "__accelsched_original__"

# --- scheduler: plugins -----------------------------------------------------------------


def notify_unregistered(scheduler: Scheduler) -> None:
    """Call ``plugin.unregistered()`` when a client unregisters a scheduler plugin that
    has one (distributed calls no hook then: not even ``close``)."""
    original = scheduler.handlers["unregister_scheduler_plugin"]
    original = getattr(original, ORIGINAL, original)

    async def unregister_scheduler_plugin(name: str) -> None:
        plugin = scheduler.plugins.get(name)
        await original(name=name)
        hook = getattr(plugin, "unregistered", None)
        if callable(hook):
            hook()

    setattr(unregister_scheduler_plugin, ORIGINAL, original)
    scheduler.handlers["unregister_scheduler_plugin"] = unregister_scheduler_plugin


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
        for r, quantity in used.items():
            if r in ws.used_resources:
                ws.used_resources[r] = quantity
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
        ts.worker_restrictions = None
        ts.host_restrictions = None


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
        kept = {k: v for k, v in resources.items() if k != name}
        ts.annotations = {**annotations, "resources": kept}


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


def ready_tasks(scheduler: Scheduler) -> Iterator[TaskState]:
    """Every task ready to run or running: queued, unrunnable (``no-worker``), and
    processing on a worker (what elastic pools size themselves by)."""
    yield from getattr(scheduler, "queued", ())
    yield from scheduler.unrunnable
    for ws in scheduler.workers.values():
        yield from ws.processing


def expected_seconds(scheduler: Scheduler, ts: TaskState) -> float:
    """How long ``ts`` is expected to run: its prefix's average, as distributed's own
    occupancy and adaptive target reckon it."""
    return float(scheduler._get_prefix_duration(ts.prefix))


def busy(ws: WorkerState) -> bool:
    """Whether ``ws`` has tasks processing (running or queued there)."""
    return bool(ws.processing)


def gpu_busy(ws: WorkerState) -> bool:
    """Whether ``ws`` has GPU tasks processing (running or queued there). Read from the
    tasks, not ``used_resources``: distributed's work stealing moves a task without
    moving what it holds there, so after a GPU task moved between workers (what
    accelsched's restarts and joins ask for) the figures of both are off."""
    return any(
        GPU in r or GPU_MEMORY in r for ts in ws.processing if (r := ts.resource_restrictions)
    )


def offer_unrunnable(scheduler: Scheduler, ws: WorkerState) -> None:
    """Offer ``no-worker`` tasks to ``ws`` (``add_resources`` does not)."""
    recs = scheduler.bulk_schedule_unrunnable_after_adding_worker(ws)
    if recs:
        scheduler.transitions(recs, stimulus_id=f"accelsched-gpu-verified-{time()}")
