"""What the command line borrows from distributed: address schemes, the scheduler file."""

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
