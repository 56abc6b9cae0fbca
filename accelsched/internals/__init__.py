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
(:mod:`.contract`; :mod:`.servers`, either side's server and preloads; :mod:`.scheduler`;
:mod:`.worker`; :mod:`.client_side`, the command line's, elastic pools' and testing's;
the nanny's :mod:`.forkserver`, imported where used), all re-exported here so callers
write ``internals.spawn(...)``.
"""

from accelsched.internals.client_side import (
    add_spec_worker,
    distributed_nvml_state,
    reset_distributed_nvml,
    restore_distributed_nvml,
)
from accelsched.internals.contract import (
    TESTED_DISTRIBUTED,
    IncompatibleDistributed,
    check_scheduler,
    check_worker,
)
from accelsched.internals.scheduler import (
    add_dashboard_page,
    annotate,
    apply_resources,
    busy,
    drop_annotated_resource,
    expected_seconds,
    fail_task,
    gpu_busy,
    harden_restrictions,
    has_running_peer,
    largest_gpu_count,
    notify_unregistered,
    offer_unrunnable,
    ready_tasks,
    release_unfit,
    replace_worker,
    restore_handler,
    restrict_to_own,
    restricted_to,
    resume,
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
    plugin_modules,
    remove_metric,
    runs_in_thread,
    set_own_gpus,
    stored_value,
    tasks_in_threads,
    worker_in_service,
    wrap_execution,
    wrap_task,
)

__all__ = [
    "TESTED_DISTRIBUTED",
    "Bound",
    "IncompatibleDistributed",
    "add_dashboard_page",
    "add_metric",
    "add_spec_worker",
    "advertises_gpus",
    "annotate",
    "drop_annotated_resource",
    "apply_resources",
    "check_scheduler",
    "check_worker",
    "declared_gpus",
    "distributed_nvml_state",
    "fail_task",
    "harden_restrictions",
    "has_running_peer",
    "install_handler",
    "largest_gpu_count",
    "notify_unregistered",
    "offer_unrunnable",
    "ready_tasks",
    "expected_seconds",
    "busy",
    "gpu_busy",
    "plugin_modules",
    "release_unfit",
    "remove_handler",
    "remove_metric",
    "replace_worker",
    "reset_distributed_nvml",
    "restore_handler",
    "runs_in_thread",
    "restore_distributed_nvml",
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
    "stored_value",
    "take_share",
    "tasks_in_threads",
    "task_spec",
    "unrunnable",
    "worker_in_service",
    "worker_metric",
    "worker_plugin_registered",
    "wrap_execution",
    "wrap_handler",
    "wrap_task",
]
