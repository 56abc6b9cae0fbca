"""Keep the demo's console to the demo's own lines.

distributed logs at INFO in every process it starts (a nanny's ``silence_logs`` only
quiets the nanny's own logger in the worker process), and accelsched's workers log what
their events already say. The demo reports through events, so for its duration the
loggers of this process are raised to ERROR, and the worker processes start with
``logging.distributed``/``logging.accelsched`` at ERROR (dask config from the
environment, set through ``distributed.nanny.pre-spawn-environ`` so that restarted workers
get it too). Everything is put back afterwards: the demo also runs inside other programs
(its test).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

import dask

__all__ = ["quiet_logs"]

_ROOTS = ("distributed", "accelsched", "tornado", "bokeh")
_ENV = {"DASK_LOGGING__DISTRIBUTED": "error", "DASK_LOGGING__ACCELSCHED": "error"}


@contextlib.contextmanager
def quiet_logs(level: int = logging.ERROR) -> Iterator[None]:
    """``level`` and above only, here (and ERROR in the workers started inside the
    block)."""
    names = [n for n in [*_ROOTS, *logging.root.manager.loggerDict] if n.split(".")[0] in _ROOTS]
    levels = {n: logging.getLogger(n).level for n in names}
    saved_env = {k: os.environ.get(k) for k in _ENV}  # the nanny writes them into os.environ
    spawn = {**dask.config.get("distributed.nanny.pre-spawn-environ", {}), **_ENV}
    try:
        for n in names:
            logging.getLogger(n).setLevel(level)
        with dask.config.set({"distributed.nanny.pre-spawn-environ": spawn}):
            yield
    finally:
        for n, level in levels.items():
            logging.getLogger(n).setLevel(level)
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
