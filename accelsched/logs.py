"""accelsched's loggers, set up the way distributed sets up its own.

Every module logs under ``accelsched`` (``accelsched.scheduler.fallback``, ...). distributed,
when imported, reads dask's ``logging`` config: in its short form
(``logging: {distributed: info, accelsched: debug}``, or ``DASK_LOGGING__ACCELSCHED=debug``)
it gives each logger named there its level and a stderr handler in
``distributed.admin.log-format``, and ``distributed`` itself INFO when the config does not
name it. :func:`initialize_logging` gives ``accelsched`` that same default: INFO, and a
stderr handler in distributed's format, so a scheduler's or a worker's log shows what
accelsched does (the options in effect, every event) beside distributed's lines, each once.

It steps aside where the operator said more:

- the config names ``accelsched``: distributed sets it up, with that level;
- the config is the full ``logging.config`` form (``version: 1``) or a file
  (``logging-file-config``): that configuration owns every logger, accelsched's too;
- a level was set on ``accelsched`` already (by the application): it is kept;
- the root logger has a handler (``logging.basicConfig``, pytest's capture): accelsched's
  records go there alone (the handler here passes nothing while the root has one), so a
  line is never printed twice and ``caplog`` sees them.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping
from typing import Any

import dask

__all__ = ["LOGGER", "initialize_logging"]

#: The parent of every accelsched logger.
LOGGER = "accelsched"
#: distributed's ``distributed.admin.log-format`` default, for a process that has not
#: imported distributed (its config defaults are loaded by its import).
_FORMAT = "%(asctime)s - %(name)s - %(levelname)s - %(message)s"


#: The handler added here, once per process.
_handler: logging.Handler | None = None


class _WhileRootHasNoHandler(logging.Filter):
    """Pass records only while the root logger has no handler: once the application
    configured logging, its handlers print accelsched's records (they propagate)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not logging.getLogger().hasHandlers()  # the root's own (it has no parent)


def initialize_logging(config: Mapping[str, Any] | None = None) -> bool:
    """Give the ``accelsched`` logger distributed's defaults (INFO, a stderr handler in
    its format) unless dask's ``logging`` config or the application set it up; True when
    it did. Safe to call again: nothing is added twice."""
    config = dask.config.config if config is None else config
    # where distributed looks for the logging keys: under ``distributed`` first, else at
    # the top (as ``distributed.config._find_logging_config``)
    nested = config.get("distributed", {})
    keys = {"logging", "logging-file-config"}
    base = nested if isinstance(nested, Mapping) and keys & nested.keys() else config
    short = base.get("logging", {})
    if (
        "logging-file-config" in base
        or not isinstance(short, Mapping)
        or "version" in short
        or LOGGER in short
    ):
        return False
    logger = logging.getLogger(LOGGER)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    global _handler
    if _handler is None:
        _handler = logging.StreamHandler(sys.stderr)
        fmt = dask.config.get("distributed.admin.log-format", _FORMAT)
        _handler.setFormatter(logging.Formatter(fmt))
        _handler.addFilter(_WhileRootHasNoHandler())
        logger.addHandler(_handler)
    return True
