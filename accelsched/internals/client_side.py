"""What the command line and elastic pools borrow from distributed: address schemes, the
scheduler file, retiring workers by name."""

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


async def retire_named(scheduler_comm: Any, names: list[str]) -> set[str]:
    """Retire workers by name through the scheduler (their data copied to peers first, as
    ``Adaptive.scale_down`` does); the names it did retire. A worker whose data no peer
    can take is not retired: it keeps running, and its data. A retired worker stays
    registered, closing gracefully, until its cluster closes it (no heartbeat of a
    removed worker that is still up)."""
    retired = await scheduler_comm.retire_workers(names=names, remove=False, close_workers=False)
    return {str(info.get("name")) for info in (retired or {}).values()}
