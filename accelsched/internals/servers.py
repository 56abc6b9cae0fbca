"""Scheduler or worker alike: handlers, periodic callbacks, background tasks; installing
the plugins from a preload and stopping a server whose preload failed.

A client registers a scheduler plugin through ``Scheduler.register_scheduler_plugin`` and a
worker plugin through ``Scheduler.register_worker_plugin``, which stores it for every
future worker and sends it to those present. A preload runs inside the server's start,
with no client: :func:`install_on_scheduler` does the same from there.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import suppress
from typing import TYPE_CHECKING, Any

from distributed.protocol.pickle import dumps, loads
from tornado.ioloop import PeriodicCallback

from accelsched.protocol import FAST_RESTART_PLUGIN, GUARD_PLUGIN, PLACEMENT_PLUGIN

if TYPE_CHECKING:
    from distributed import Scheduler, Worker
    from distributed.diagnostics.plugin import NannyPlugin, SchedulerPlugin, WorkerPlugin


def serving(server: Any) -> bool:
    """Whether the server answers RPCs now: every incoming comm first awaits the
    server's start, which holds ``_startup_lock`` until ``start_unsafe`` returns (worker
    plugins registered before a worker starts are set up inside it)."""
    return not server._startup_lock.locked()


def install_handler(server: Any, name: str, handler: Callable[..., Any]) -> None:
    """Serve ``handler`` as RPC ``name`` (replacing a previous instance's)."""
    server.handlers[name] = handler


def remove_handler(server: Any, name: str, handler: Callable[..., Any]) -> None:
    """Remove RPC ``name`` if it is still ``handler`` (not a newer instance's)."""
    if server.handlers.get(name) == handler:
        del server.handlers[name]


def start_periodic(server: Any, name: str, callback: Callable[[], Any], seconds: float) -> None:
    """Run ``callback`` every ``seconds``; replaces (and stops) one of the same name.

    A PeriodicCallback added after the server started is not started by distributed.
    """
    stop_periodic(server, name)
    pc = server.periodic_callbacks[name] = PeriodicCallback(callback, seconds * 1000)
    pc.start()


def stop_periodic(server: Any, name: str) -> None:
    pc = server.periodic_callbacks.pop(name, None)
    if pc is not None:
        pc.stop()


def spawn(server: Any, fn: Callable[..., Any], *args: Any) -> None:
    """Run ``fn(*args)`` (a coroutine function) in the background; the server's close
    cancels it, and its exceptions are logged by distributed."""
    server._ongoing_background_tasks.call_soon(fn, *args)


async def install_on_scheduler(
    scheduler: Scheduler,
    placement: SchedulerPlugin,
    guard: WorkerPlugin,
    nanny_plugin: NannyPlugin | None,
) -> None:
    """What ``register`` does, from the scheduler's own preload: add ``placement`` (a
    preload runs before the scheduler calls every plugin's ``start``, so adding is enough:
    ``register_scheduler_plugin`` would start it twice), and hand ``guard`` to every
    worker and ``nanny_plugin`` to every nanny, present and future, as
    ``client.register_plugin`` does on the scheduler; each unless one of its name is
    registered already."""
    scheduler.add_plugin(placement, name=PLACEMENT_PLUGIN, idempotent=True)
    await scheduler.register_worker_plugin(
        None, plugin=dumps(guard), name=GUARD_PLUGIN, idempotent=True
    )
    if nanny_plugin is not None:
        await scheduler.register_nanny_plugin(
            None, plugin=dumps(nanny_plugin), name=FAST_RESTART_PLUGIN, idempotent=True
        )


async def stop(server: Scheduler | Worker, reason: str, in_nanny: Callable[[], None]) -> None:
    """Close ``server`` once its start has returned (closing a server that is still
    starting does nothing; so run it as a callback of the server's loop). A worker takes
    its nanny with it, which would otherwise start it again and again; ``in_nanny`` (an
    importable function) runs in the nanny's process first, where ``dask worker`` runs
    (the worker is a child process)."""
    from distributed import Worker

    try:
        await server.start()
    except Exception:  # its start failed: it is closed already
        return
    # a worker's nanny: its address (typed as a Nanny in distributed)
    nanny: Any = server.nanny if isinstance(server, Worker) else None
    if nanny is not None:
        # the nanny's out-of-band "run" handler, as client.run(nanny=True); a nanny
        # gone already has nothing to tell
        with suppress(Exception):
            await server.rpc(nanny).run(function=dumps(in_nanny))
    await server.close(reason=reason)  # a worker's nanny too (Worker.close's default)


def running_plugins(dask_scheduler: Scheduler) -> dict[str, Any]:
    """Run on the scheduler (``client.run_on_scheduler``): accelsched's plugins registered
    there, None where none is (they travel as their options: the guard as stored for the
    workers, before each worker's own settings)."""
    guard = dask_scheduler.worker_plugins.get(GUARD_PLUGIN)
    return {
        "placement": dask_scheduler.plugins.get(PLACEMENT_PLUGIN),
        "guard": loads(guard) if guard is not None else None,
    }
