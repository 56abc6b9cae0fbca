"""What the command line and elastic pools borrow from distributed: address schemes, the
scheduler file, a worker spec's class, retiring workers by name, the cluster's adaptive
controller."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def check_scheme(scheme: str) -> None:
    """Raise ``ValueError`` when distributed knows no comm backend for ``scheme``."""
    from distributed.comm.registry import get_backend

    get_backend(scheme)


def read_json_file(path: str, load: Callable[[Any], Any], timeout: float) -> Any:
    """distributed's own reader of a scheduler file: retries a file still being written
    until ``timeout`` (``TimeoutError`` after it), as ``Client(scheduler_file=...)`` does."""
    from distributed.utils import json_load_robust

    return json_load_robust(path, load=load, timeout=timeout)


def spec_class(cls: Any) -> Any:
    """A worker spec's ``cls`` as ``SpecCluster`` reads it: a class, or its import path."""
    from distributed.utils import import_term

    return import_term(cls) if isinstance(cls, str) else cls


async def retire_named(scheduler_comm: Any, names: list[str]) -> set[str]:
    """Retire workers by name through the scheduler (their data copied to peers first, as
    ``Adaptive.scale_down`` does); the names it did retire. A worker whose data no peer
    can take is not retired: it keeps running, and its data. A retired worker stays
    registered, closing gracefully, until its cluster closes it (no heartbeat of a
    removed worker that is still up)."""
    retired = await scheduler_comm.retire_workers(names=names, remove=False, close_workers=False)
    return {str(info.get("name")) for info in (retired or {}).values()}


def take_adaptive(cluster: Any, controller: Any) -> Any:
    """Make ``controller`` the cluster's one adaptive controller, as ``Cluster.adapt``
    does: the one before is stopped, and closing the cluster or a later ``cluster.adapt()``
    stops this one (two controllers would fight over one cluster's workers). Returns the
    one before if it was sizing the cluster (starting or running), else None."""
    previous = getattr(cluster, "_adaptive", None)
    cluster._adaptive = controller
    if previous is None or previous is controller:
        return None
    active = getattr(previous, "state", None) in ("starting", "running")
    previous.stop()
    return previous if active else None
