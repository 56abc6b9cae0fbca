"""accelsched: GPUs as real, scarce, fallible hardware for Dask's distributed scheduler.

- :class:`PlacementPlugin` (scheduler): verification gate, exclusive devices, strict
  placement, CPU fallback, restart coordination.
- :class:`GuardPlugin` (workers): NVML inventory, per-task device binding, pool freeing,
  leak detection.
- :func:`register` registers both; :func:`dual` and :func:`gpu` mark GPU steps in code,
  :func:`array_module` and :func:`current_device` are for task code.
"""

from __future__ import annotations

import functools
import logging
from importlib import import_module
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

from accelsched import config as _config  # noqa: F401  (loads the config defaults)
from accelsched.config import GUARD_OPTIONS, PLACEMENT_OPTIONS
from accelsched.context import array_module, current_device

# ``dual`` shares its name with its module: imported here, the function wins over the
# submodule attribute that importing ``accelsched.dual`` sets
from accelsched.dual import dual, gpu

if TYPE_CHECKING:
    from accelsched.deploy.forked_workers import FastRestart
    from accelsched.deploy.install import dask_setup, dask_teardown
    from accelsched.scheduler.placement_plugin import PlacementPlugin
    from accelsched.worker.guard_plugin import GuardPlugin

_logger = logging.getLogger(__name__)

try:
    __version__ = version("accelsched")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0+unknown"

__all__ = [
    "PlacementPlugin",
    "GuardPlugin",
    "register",
    "dual",
    "gpu",
    "array_module",
    "current_device",
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
    "FastRestart": "accelsched.deploy.forked_workers",
    "dask_setup": "accelsched.deploy.install",
    "dask_teardown": "accelsched.deploy.install",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'accelsched' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


def register(client: Any, **options: Any) -> tuple[PlacementPlugin, GuardPlugin]:
    """Register the PlacementPlugin and the GuardPlugin on ``client``'s cluster.

    Options go to the plugin that owns them (``fallback_timeout`` to placement,
    ``leak_threshold`` to the guard, ...). Idempotent: when plugins of these names are
    already registered (by an earlier call or the scheduler's ``--preload accelsched``)
    they are kept, and an option given here that differs from what they run with raises
    ``ValueError`` naming both values (unregister them first to change options); this
    client's own config that differs is only logged (:mod:`accelsched.precedence`).
    With an asynchronous client, await the result.
    The scheduler plugin goes first so the guards' reports find it listening. With
    ``fast_restart`` (the default), a nanny plugin (:class:`~accelsched.deploy.forked_workers.
    FastRestart`) makes the nannies start new worker processes from a fork server.
    """
    from accelsched.deploy.forked_workers import FastRestart
    from accelsched.internals.preloading import running_options
    from accelsched.scheduler.placement_plugin import PlacementPlugin
    from accelsched.worker.guard_plugin import GuardPlugin

    placement_names = {o.name for o in PLACEMENT_OPTIONS}
    guard_names = {o.name for o in GUARD_OPTIONS}
    unknown = sorted(set(options) - placement_names - guard_names)
    if unknown:
        raise TypeError(
            f"register() got unknown option(s) {', '.join(map(repr, unknown))}; valid "
            f"options: {', '.join(sorted(placement_names | guard_names))}"
        )
    placement = PlacementPlugin(**{k: v for k, v in options.items() if k in placement_names})
    guard = GuardPlugin(**{k: v for k, v in options.items() if k in guard_names})
    placement.idempotent = True  # type: ignore[attr-defined]
    guard.idempotent = True  # type: ignore[attr-defined]
    plugins: list[Any] = [placement, guard]
    if guard.options["fast_restart"]:  # nannies fork new worker processes from a server
        plugins.append(FastRestart())
    check = functools.partial(_check_running, options, placement, guard)
    if getattr(client, "asynchronous", False):

        async def register_all() -> tuple[PlacementPlugin, GuardPlugin]:
            check(await client.run_on_scheduler(running_options))
            for plugin in plugins:
                await client.register_plugin(plugin)
            return placement, guard

        return register_all()  # type: ignore[return-value]
    check(client.run_on_scheduler(running_options))
    for plugin in plugins:
        client.register_plugin(plugin)
    return placement, guard


def _check_running(
    given: dict[str, Any],
    placement: PlacementPlugin,
    guard: GuardPlugin,
    running: dict[str, dict[str, Any] | None],
) -> None:
    """Raise if a plugin already running is kept while an option given here differs
    from what it runs with; log this client's config that differs."""
    from accelsched.precedence import conflicts

    errors, notes = [], []
    for owner, options, built in (
        ("PlacementPlugin", PLACEMENT_OPTIONS, placement.options),
        ("GuardPlugin", GUARD_OPTIONS, guard.options),
    ):
        now = running["placement" if options is PLACEMENT_OPTIONS else "guard"]
        if now is not None:
            e, n = conflicts(owner, options, given, built, now)
            errors += e
            notes += n
    if errors:
        raise ValueError(
            f"register() was given {'; '.join(errors)}: accelsched's plugins already run "
            "on this scheduler (its --preload accelsched or an earlier register()) and are "
            "kept. Unregister them first to change options (docs/placement.md), or set the "
            "option where the scheduler is started"
        )
    for note in notes:
        _logger.warning("accelsched: this client's dask config %s: not used", note)
