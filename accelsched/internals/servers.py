"""Scheduler or worker alike: handlers, periodic callbacks, background tasks, timers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tornado.ioloop import PeriodicCallback


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
    pc = PeriodicCallback(callback, seconds * 1000)
    server.periodic_callbacks[name] = pc
    pc.start()


def stop_periodic(server: Any, name: str) -> None:
    pc = server.periodic_callbacks.pop(name, None)
    if pc is not None:
        pc.stop()


def spawn(server: Any, fn: Callable[..., Any], *args: Any) -> None:
    """Run ``fn(*args)`` (a coroutine function) in the background; the server's close
    cancels it, and its exceptions are logged by distributed."""
    server._ongoing_background_tasks.call_soon(fn, *args)
