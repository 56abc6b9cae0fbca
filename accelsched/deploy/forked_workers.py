"""Restarts in a fraction of a second: nannies start worker processes from a fork server.

A leaking worker's restart is mostly a process start: with distributed's default
(``spawn``), a new interpreter imports distributed, dask and accelsched again (about half
a second here) and the old one shuts its interpreter down first. :class:`FastRestart` is
a nanny plugin (``distributed.diagnostics.plugin.NannyPlugin``) that switches its nanny's
process to ``multiprocessing``'s ``forkserver``: a server process imports all that once,
accelsched and pynvml included, and forks each new worker process from itself
(:mod:`accelsched.internals.forkserver`). Nothing that initialises CUDA is imported there,
so a forked worker creates its CUDA context itself, as a spawned one does.

:func:`accelsched.register` and ``dask scheduler --preload accelsched`` register it with
the GuardPlugin unless ``fast_restart`` is off. It acts on the nanny's *process*: every
nanny of that process (all of a ``LocalCluster``'s, which live in the client's process)
starts its workers this way while one of them has the plugin; the method is restored
once the last one closes. A worker process a nanny started before the plugin arrived is
replaced, at its next restart, by a forked one.
"""

from __future__ import annotations

import logging
from typing import Any

from distributed.diagnostics.plugin import NannyPlugin

from accelsched.internals import forkserver
from accelsched.protocol import FAST_RESTART_PLUGIN

__all__ = ["FastRestart"]

logger = logging.getLogger(__name__)


class FastRestart(NannyPlugin):
    """Start this nanny's next worker processes from a warm fork server."""

    name = FAST_RESTART_PLUGIN
    idempotent = True

    def setup(self, nanny: Any) -> None:
        if not forkserver.use_forkserver(nanny):
            logger.info("accelsched: no forkserver start method here; restarts spawn")

    def teardown(self, nanny: Any) -> None:
        forkserver.release_forkserver(nanny)
