"""accelsched: GPUs as real, scarce, fallible hardware for Dask's distributed scheduler.

- :class:`PlacementPlugin` (scheduler): verification gate, exclusive devices, strict
  placement, CPU fallback, restart coordination.
- :class:`GuardPlugin` (workers): NVML inventory, per-task device binding, pool freeing,
  leak detection.
- :func:`register` registers both; :func:`dual` and :func:`gpu` mark GPU steps in code,
  :func:`array_module` and :func:`current_device` are for task code;
  :class:`DeclaredMemoryExceeded` is what a task held to its declared memory raises.
"""

from __future__ import annotations

from importlib import import_module
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

from accelsched import config as _config  # (loads the config defaults)
from accelsched.context import array_module, current_device, dual, gpu
from accelsched.devices import DeclaredMemoryExceeded

if TYPE_CHECKING:
    from accelsched.deploy.adapt import ElasticPools, adapt
    from accelsched.deploy.install import dask_setup, dask_teardown
    from accelsched.internals.forkserver import FastRestart
    from accelsched.scheduler.placement_plugin import PlacementPlugin
    from accelsched.worker.guard_plugin import GuardPlugin

_config.initialize_logging()  # accelsched's log lines beside distributed's

try:
    __version__ = version("accelsched")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0+unknown"

__all__ = [
    "PlacementPlugin",
    "GuardPlugin",
    "register",
    "adapt",
    "ElasticPools",
    "dual",
    "gpu",
    "array_module",
    "current_device",
    "DeclaredMemoryExceeded",
    "dask_setup",
    "dask_teardown",
    "FastRestart",
    "__version__",
]

#: The public names and the modules that hold them, imported on first use: a process
#: that only needs a decision module (``accelsched.policy``) or the command line does not
#: load distributed, and ``--preload accelsched`` finds ``dask_setup`` here all the same.
_LAZY = {
    "PlacementPlugin": "accelsched.scheduler.placement_plugin",
    "GuardPlugin": "accelsched.worker.guard_plugin",
    "FastRestart": "accelsched.internals.forkserver",
    "dask_setup": "accelsched.deploy.install",
    "dask_teardown": "accelsched.deploy.install",
    "adapt": "accelsched.deploy.adapt",
    "ElasticPools": "accelsched.deploy.adapt",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:  # kept, so asked once
        return globals().setdefault(name, getattr(import_module(_LAZY[name]), name))
    raise AttributeError(f"module 'accelsched' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


def register(client: Any, **options: Any) -> tuple[PlacementPlugin, GuardPlugin]:
    """Register the PlacementPlugin and the GuardPlugin on ``client``'s cluster.

    Options go to the plugin that owns them (``fallback_timeout`` to placement,
    ``leak_threshold`` to the guard, ...). Idempotent: when plugins of these names are
    already registered (by an earlier call or the scheduler's ``--preload accelsched``)
    they are kept, and copies carrying the options they run with are returned: an option
    given here that differs from what they run with raises ``ValueError`` naming both
    values (unregister them first to change options); this client's own config that
    differs is only logged (:mod:`accelsched.config`).
    With an asynchronous client, await the result.
    The scheduler plugin goes first so the guards' reports find it listening. With
    ``fast_restart`` (the default), a nanny plugin (:class:`~accelsched.FastRestart`)
    makes the nannies start new worker processes from a fork server.
    """
    from accelsched import FastRestart, GuardPlugin, PlacementPlugin  # (loaded now: _LAZY)
    from accelsched.internals.servers import running_plugins

    _config.refuse_unknown(options, _config.PLACEMENT_OPTIONS + _config.GUARD_OPTIONS, "register()")
    if not all(callable(getattr(client, m, None)) for m in ("sync", "register_plugin")):
        raise TypeError(f"register() takes a distributed Client, not {client!r:.80}")
    placement = PlacementPlugin(**_config.only(_config.PLACEMENT_OPTIONS, options))
    guard = GuardPlugin(**_config.only(_config.GUARD_OPTIONS, options))
    placement.idempotent = guard.idempotent = True  # type: ignore[attr-defined]
    # with fast_restart, nannies fork new worker processes from a server
    fast = [FastRestart()] if guard.options["fast_restart"] else []

    async def register_all() -> tuple[PlacementPlugin, GuardPlugin]:
        running = await client.run_on_scheduler(running_plugins)
        _config.check_running(
            options,
            {"placement": placement.options, "guard": guard.options},
            {side: getattr(plugin, "options", None) for side, plugin in running.items()},
        )
        for plugin in [placement, guard, *fast]:
            await client.register_plugin(plugin)
        return running["placement"] or placement, running["guard"] or guard

    # an asynchronous client hands back the coroutine; a synchronous one runs it
    return client.sync(register_all)  # type: ignore[no-any-return]
