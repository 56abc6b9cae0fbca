"""Modules a worker imports whole before its first task (``preimport``).

Python imports a package's modules under per-module locks, and when two threads import
parts of one package whose modules import each other (``dask.dataframe`` and
``dask.dataframe.dask_expr`` do), the import system breaks the cycle by handing one
thread a partially initialised module: ``ImportError: cannot import name 'DataFrame'
from partially initialized module 'dask.dataframe.dask_expr'`` (or ``_DeadlockError``).
A worker meets that when its first DataFrame work arrives as several tasks at once,
which is what a CPU worker beside GPU workers sees when a batch of GPU tasks falls back
to it together; raised where the worker reads a task message rather than inside a task,
it closes the worker (distributed's ``fail_hard``), and the nanny with it.

The guard imports these modules in its ``setup``, on the worker's event loop: a worker
reads no task message before its plugins are set up, so no task thread can be importing
at that moment and each module is whole before the first task runs. A module that is
not installed (``dask.dataframe`` without pandas) is skipped.
"""

from __future__ import annotations

import importlib
import logging
import time

__all__ = ["preimport"]

logger = logging.getLogger(__name__)


def preimport(modules: tuple[str, ...]) -> list[str]:
    """Import ``modules``; the names imported (skipped: not installed, or failing)."""
    done: list[str] = []
    for name in modules:
        start = time.perf_counter()
        try:
            importlib.import_module(name)
        except ImportError as exc:  # not installed here (or a dependency is not)
            logger.info("accelsched: preimport %s skipped: %s", name, exc)
            continue
        except Exception as exc:  # a module that fails to import costs its guard nothing
            logger.warning("accelsched: preimport %s failed: %r", name, exc)
            continue
        done.append(name)
        logger.debug("accelsched: preimported %s in %.2f s", name, time.perf_counter() - start)
    return done
