"""accelsched: GPUs as real, scarce, fallible hardware for Dask's distributed scheduler.

- :class:`PlacementPlugin` (scheduler): verification gate, exclusive devices, strict
  placement, CPU fallback, restart coordination.
- :class:`GuardPlugin` (workers): NVML inventory, per-task device binding, pool freeing,
  leak detection.
- :func:`register` registers both; :func:`dual`, :func:`array_module` and
  :func:`current_device` are for task code.
"""

from __future__ import annotations

import warnings
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import dask.config

from accelsched import config as _config  # noqa: F401  (loads the config defaults)
from accelsched.config import GUARD_OPTIONS, PLACEMENT_OPTIONS
from accelsched.context import array_module, current_device
from accelsched.dual import dual
from accelsched.guard import GuardPlugin
from accelsched.placement import PlacementPlugin

try:
    __version__ = version("accelsched")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0+unknown"

__all__ = [
    "PlacementPlugin",
    "GuardPlugin",
    "register",
    "dual",
    "array_module",
    "current_device",
    "__version__",
]


def register(client: Any, **options: Any) -> tuple[PlacementPlugin, GuardPlugin]:
    """Register the PlacementPlugin and the GuardPlugin on ``client``'s cluster.

    Options go to the plugin that owns them (``fallback_timeout`` to placement,
    ``leak_threshold`` to the guard, ...). Idempotent: when plugins of these names are
    already registered, nothing changes (unregister them first to change options).
    With an asynchronous client, await the result.
    The scheduler plugin goes first so the guards' reports find it listening.
    """
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
    _warn_if_fusion_drops_annotations()
    placement.idempotent = True  # type: ignore[attr-defined]
    guard.idempotent = True  # type: ignore[attr-defined]
    if getattr(client, "asynchronous", False):

        async def register_both() -> tuple[PlacementPlugin, GuardPlugin]:
            await client.register_plugin(placement)
            await client.register_plugin(guard)
            return placement, guard

        return register_both()  # type: ignore[return-value]
    client.register_plugin(placement)
    client.register_plugin(guard)
    return placement, guard


def _warn_if_fusion_drops_annotations() -> None:
    """Low-level task fusion drops ``dask.annotate`` annotations (dask#7036).

    A dask.array step annotated ``resources={"GPU": 1}`` then reaches the scheduler as a
    plain task: nothing places it on a GPU and nothing guards it. distributed documents
    the fix, which is the user's to choose because it changes every computation.
    """
    if dask.config.get("optimization.fuse.active", None) is not False:
        warnings.warn(
            "dask's low-level task fusion (optimization.fuse.active) drops "
            "dask.annotate(resources=...) from fused dask.array tasks, so GPU steps would "
            "run unplaced and unguarded. Set dask.config.set({'optimization.fuse.active': "
            "False}) in the client process, or compute with optimize_graph=False.",
            UserWarning,
            stacklevel=3,
        )
