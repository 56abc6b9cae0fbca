"""Installing the plugins from a preload (``--preload accelsched``), with no client.

A client registers a scheduler plugin through ``Scheduler.register_scheduler_plugin`` and a
worker plugin through ``Scheduler.register_worker_plugin``, which stores it for every
future worker and sends it to those present. A preload runs inside the server's start,
with no client: these functions do the same from there.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from contextlib import suppress
from typing import TYPE_CHECKING, Any

from distributed.protocol.pickle import dumps, loads

from accelsched.internals.contract import _raise_if

if TYPE_CHECKING:
    from distributed import Scheduler, Worker
    from distributed.diagnostics.plugin import SchedulerPlugin, WorkerPlugin


def add_scheduler_plugin(scheduler: Scheduler, plugin: SchedulerPlugin, name: str) -> None:
    """Add ``plugin`` unless one of that name is there; the scheduler starts it.

    A preload runs before the scheduler calls every plugin's ``start``, so adding is
    enough (``register_scheduler_plugin`` would start it twice).
    """
    scheduler.add_plugin(plugin, name=name, idempotent=True)


async def hand_to_workers(scheduler: Scheduler, plugin: WorkerPlugin, name: str) -> None:
    """What ``client.register_plugin(worker_plugin)`` does on the scheduler: every worker,
    present and future, sets the plugin up (unless one of that name is registered)."""
    method = getattr(scheduler, "register_worker_plugin", None)
    try:
        params = inspect.signature(method).parameters if callable(method) else {}
    except (TypeError, ValueError):
        params = {}
    if not {"plugin", "name", "idempotent"} <= set(params):
        _raise_if(
            ["Scheduler.register_worker_plugin(comm, plugin, name, idempotent) is gone"],
            "scheduler",
        )
    assert method is not None
    await method(None, plugin=dumps(plugin), name=name, idempotent=True)


async def hand_to_nannies(scheduler: Scheduler, plugin: Any, name: str) -> None:
    """What ``client.register_plugin(nanny_plugin)`` does on the scheduler: every nanny,
    present and future, sets the plugin up (unless one of that name is registered)."""
    await scheduler.register_nanny_plugin(None, plugin=dumps(plugin), name=name, idempotent=True)


async def started(server: Scheduler | Worker) -> None:
    """Return once ``server`` has started (at once if it has): a worker is registered
    with its scheduler by then. Raises if its start failed."""
    await server.start()


def worker_plugin(worker: Worker, name: str) -> Any:
    """The worker plugin of that name set up on ``worker``, or None."""
    return worker.plugins.get(name)


def stop(
    server: Scheduler | Worker, reason: str, in_nanny: Callable[[], None] | None = None
) -> None:
    """Close ``server`` once its start has returned (closing a server that is still
    starting does nothing). A worker takes its nanny with it, which would otherwise
    start it again and again; ``in_nanny`` (an importable function) runs in the nanny's
    process first, where ``dask worker`` runs (the worker is a child process)."""
    server.loop.add_callback(_close_after_start, server, reason, in_nanny)


async def _close_after_start(
    server: Scheduler | Worker, reason: str, in_nanny: Callable[[], None] | None
) -> None:
    from distributed import Worker

    try:
        await server.start()
    except Exception:  # its start failed: it is closed already
        return
    if isinstance(server, Worker):
        nanny: Any = server.nanny  # its address (typed as a Nanny in distributed)
        if in_nanny is not None and nanny is not None:
            # the nanny's out-of-band "run" handler, as client.run(nanny=True); a nanny
            # gone already has nothing to tell
            with suppress(Exception):
                await server.rpc(nanny).run(function=dumps(in_nanny))
        await server.close(nanny=True, reason=reason)
    else:
        await server.close(reason=reason)


def running_options(dask_scheduler: Scheduler) -> dict[str, dict[str, Any] | None]:
    """Run on the scheduler (``client.run_on_scheduler``): the options of accelsched's
    plugins registered there, if any (the guard as stored for the workers, before each
    worker's own settings)."""
    from accelsched.protocol import GUARD_PLUGIN, PLACEMENT_PLUGIN

    placement = dask_scheduler.plugins.get(PLACEMENT_PLUGIN)
    guard = dask_scheduler.worker_plugins.get(GUARD_PLUGIN)
    return {
        "placement": getattr(placement, "options", None),
        "guard": getattr(loads(guard), "options", None) if guard is not None else None,
    }
