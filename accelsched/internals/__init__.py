"""The one door to distributed's (and dask's) internals.

accelsched needs a few things distributed has no public API for: offering ``no-worker``
tasks to a worker whose GPUs were just verified, knowing since when a task has been
unrunnable, setting a worker's GPU count on the scheduler, draining a worker, wrapping a
task's execution on the worker. Each such need is one function here, and nothing else in
accelsched touches a private attribute or relies on undocumented behaviour (a test greps
for it). When distributed changes one of them, this is the only module to mend.

Hook exceptions are logged and swallowed by distributed, so a silent break would look
like accelsched simply not placing or binding. :func:`check_scheduler` and
:func:`check_worker` therefore verify, when the plugins start, everything this module
relies on, and fail the registration with :class:`IncompatibleDistributed` naming what
changed and the versions known to work. ``docs/architecture.md`` lists each use and why.

The door is this package: one function per need, grouped by the side it touches
(:mod:`.servers`, either side's server and preloads; :mod:`.scheduler`;
:mod:`.worker`; :mod:`.client_side`, the command line's, elastic pools' and testing's;
the nanny's :mod:`.forkserver`, imported where used), all re-exported here so callers
write ``internals.spawn(...)``.
"""

from __future__ import annotations

import functools
import inspect
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

from accelsched.internals.client_side import (
    add_spec_worker,
    build_error,
    built_or_failed,
    cpu_count,
    distributed_nvml_state,
    reset_distributed_nvml,
    restore_distributed_nvml,
    worker_class,
    workers_listed,
)
from accelsched.internals.scheduler import (
    add_dashboard_page,
    annotate,
    apply_resources,
    busy,
    closing,
    drop_annotated_resource,
    fail_task,
    harden_restrictions,
    has_running_peer,
    holds_results,
    idle_and_empty,
    in_service,
    largest_gpu_count,
    last_started,
    notify_unregistered,
    offer_unrunnable,
    ready_tasks,
    release_unfit,
    replace_worker,
    restore_handler,
    restrict_to_own,
    restricted_to,
    resume,
    retiring,
    run_now,
    set_resource_restrictions,
    set_worker_gpus,
    share_worker_restriction,
    take_restricted_hosts,
    take_share,
    task_spec,
    unrunnable,
    worker_metric,
    worker_plugin_registered,
    wrap_handler,
)
from accelsched.internals.servers import (
    install_handler,
    remove_handler,
    serving,
    spawn,
    start_periodic,
    stop_periodic,
)
from accelsched.internals.worker import (
    Bound,
    add_metric,
    advertises_gpus,
    declared_gpus,
    events_sent,
    heartbeat_now,
    in_memory,
    plugin_modules,
    remove_metric,
    runs_in_thread,
    set_own_gpus,
    stored_values,
    tasks_in_threads,
    worker_closing,
    worker_in_service,
    wrap_execution,
    wrap_task,
)

if TYPE_CHECKING:
    from distributed import Scheduler, Worker

__all__ = [
    "build_error",
    "built_or_failed",
    "TESTED_DISTRIBUTED",
    "Bound",
    "IncompatibleDistributed",
    "add_dashboard_page",
    "add_metric",
    "add_spec_worker",
    "advertises_gpus",
    "annotate",
    "drop_annotated_resource",
    "events_sent",
    "apply_resources",
    "check_scheduler",
    "check_worker",
    "declared_gpus",
    "distributed_nvml_state",
    "fail_task",
    "harden_restrictions",
    "has_running_peer",
    "holds_results",
    "in_service",
    "idle_and_empty",
    "install_handler",
    "largest_gpu_count",
    "last_started",
    "notify_unregistered",
    "offer_unrunnable",
    "ready_tasks",
    "busy",
    "closing",
    "plugin_modules",
    "release_unfit",
    "remove_handler",
    "heartbeat_now",
    "in_memory",
    "remove_metric",
    "replace_worker",
    "retiring",
    "reset_distributed_nvml",
    "restore_handler",
    "runs_in_thread",
    "restore_distributed_nvml",
    "worker_class",
    "workers_listed",
    "cpu_count",
    "resume",
    "run_now",
    "set_own_gpus",
    "set_resource_restrictions",
    "set_worker_gpus",
    "restrict_to_own",
    "share_worker_restriction",
    "restricted_to",
    "take_restricted_hosts",
    "serving",
    "spawn",
    "start_periodic",
    "stop_periodic",
    "stored_values",
    "take_share",
    "tasks_in_threads",
    "task_spec",
    "unrunnable",
    "worker_closing",
    "worker_in_service",
    "worker_metric",
    "worker_plugin_registered",
    "wrap_execution",
    "wrap_handler",
    "wrap_task",
]

# --- the contract: everything the door relies on, verified when the plugins start -----

#: The oldest and newest distributed releases CI runs the whole suite against
#: (``.ci/run``); ``pyproject.toml`` pins the same range.
TESTED_DISTRIBUTED: tuple[str, str] = ("2026.7.1", "2026.8.0")


class IncompatibleDistributed(RuntimeError):
    """distributed changed something accelsched relies on; registration fails loudly."""


def _raise_if(problems: list[str], side: str) -> None:
    if not problems:
        return
    try:
        running = version("distributed")
    except PackageNotFoundError:  # pragma: no cover - a source checkout of distributed
        running = "unknown"
    raise IncompatibleDistributed(
        f"accelsched cannot run on this {side}: distributed {running} "
        f"changed what it relies on: {'; '.join(problems)}. accelsched is known to work "
        f"with distributed {TESTED_DISTRIBUTED[0]} to {TESTED_DISTRIBUTED[1]}; install a "
        "version in that range."
    )


def _changed(
    obj: Any,
    owner: str,
    dicts: tuple[str, ...] = (),
    callables: tuple[str, ...] = (),
    attributes: tuple[str, ...] = (),
) -> list[str]:
    """What on ``obj`` changed: of ``dicts`` and ``callables`` (dotted paths), what is no
    longer a dict or callable; of ``attributes``, what is gone (slots and properties are
    attributes of the class itself)."""
    at = {
        n: functools.reduce(lambda o, k: getattr(o, k, None), n.split("."), obj)
        for n in dicts + callables
    }
    return (
        [f"{owner}.{n} is not a dict" for n in dicts if not isinstance(at[n], dict)]
        + [f"{owner}.{n} is gone" for n in callables if not callable(at[n])]
        + [f"{owner}.{n} is gone" for n in attributes if not hasattr(obj, n)]
    )


def check_scheduler(scheduler: Scheduler) -> None:
    """Verify what the scheduler side relies on; raise IncompatibleDistributed if not."""
    from distributed.scheduler import TaskState, WorkerState
    from distributed.stealing import WorkStealing

    handlers = getattr(scheduler, "handlers", None)
    problems = [
        *(
            f"Scheduler.handlers has no {name!r} handler"
            for name in ("set_resources", "unregister_scheduler_plugin")
            if not isinstance(handlers, dict) or name not in handlers
        ),
        *_changed(
            scheduler,
            "Scheduler",
            dicts=(
                "unrunnable",  # task -> time it became unrunnable
                "resources",
                "periodic_callbacks",
                "stream_comms",
                "worker_plugins",
                "plugins",
            ),
            callables=(
                "_ongoing_background_tasks.call_soon",
                "bulk_schedule_unrunnable_after_adding_worker",
                "_get_prefix_duration",
                "transition",
                "transitions",
                "handle_worker_status_change",
                "coerce_hostname",
            ),
        ),
        *_changed(
            WorkerState,
            "WorkerState",
            attributes=(
                "resources",
                "used_resources",
                "processing",
                "has_what",
                "nanny",
                "status",
                "metrics",
            ),
        ),
        *_changed(
            TaskState,
            "TaskState",
            attributes=(
                "resource_restrictions",
                "loose_restrictions",
                "worker_restrictions",
                "host_restrictions",
                "annotations",
                "dependencies",
                "who_has",
                "run_spec",
            ),
        ),
    ]
    if not isinstance(getattr(scheduler, "running", None), set):
        problems.append("Scheduler.running is not a set of WorkerState")
    for owner, fn, names in (
        (
            "Scheduler.retire_workers",
            type(scheduler).retire_workers,
            ("workers", "close_workers", "remove", "stimulus_id"),
        ),
        (
            "WorkStealing.move_task_request",
            WorkStealing.move_task_request,
            ("ts", "victim", "thief"),
        ),
        ("Scheduler.valid_workers", type(scheduler).valid_workers, ("ts",)),
        (
            "Scheduler.restart_workers",
            type(scheduler).restart_workers,
            ("workers", "wait_for_workers", "on_error", "stimulus_id"),
        ),
        (
            "Scheduler.request_remove_replicas",
            type(scheduler).request_remove_replicas,
            ("addr", "keys", "stimulus_id"),
        ),
    ):  # what each function no longer takes
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):
            problems.append(f"{owner} is not inspectable")
            continue
        problems += [f"{owner}() no longer takes {n}=" for n in names if n not in params]
    _raise_if(problems, "scheduler")


def check_worker(worker: Worker) -> None:
    """Verify what the worker side relies on; raise IncompatibleDistributed if not."""
    from dask._task_spec import GraphNode
    from distributed.worker_state_machine import TaskState

    from accelsched.internals import forkserver

    fields = getattr(TaskState, "__dataclass_fields__", {})  # none: no longer a dataclass
    problems = [
        *_changed(
            worker,
            "Worker",
            dicts=(
                "handlers",
                "periodic_callbacks",
                "executors",
                "plugins",
                "metrics",
                "state.tasks",
                "state.total_resources",
            ),
            callables=(
                "batched_send",
                "_ongoing_background_tasks.call_soon",
                "_startup_lock.locked",  # held while the worker starts
                "data.get",  # a mapping
                "heartbeat",  # sent at once as a guard goes (heartbeat_now)
            ),
        ),
        *(
            f"worker TaskState.{n} is gone"
            for n in ("run_spec", "annotations", "resource_restrictions", "previous", "done")
            if n not in fields
        ),
        *forkserver.missing(),  # a restarted worker starts while its GPU fails NVML
    ]
    if not hasattr(worker, "thread_id"):
        problems.append("Worker.thread_id (the worker's stream) is gone")
    stream = getattr(worker, "batched_stream", None)  # (events_sent reads how far it is)
    if stream is None:
        problems.append("Worker.batched_stream is gone")
    else:
        problems += [
            f"Worker.batched_stream.{n} is gone"
            for n in ("buffer", "byte_count", "interval", "please_stop")
            if not hasattr(stream, n)
        ]
    # (dask._task_spec without GraphNode or Task: accelsched.internals fails to import)
    if not hasattr(GraphNode, "is_coro") or not hasattr(GraphNode, "dependencies"):
        problems.append("dask._task_spec.GraphNode lost is_coro or dependencies")
    _raise_if(problems, "worker")
