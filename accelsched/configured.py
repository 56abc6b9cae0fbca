"""``--preload accelsched.configured``: the plugins, options from dask config only.

``--preload accelsched`` takes preload arguments, so distributed counts it as a
"click-configurable" preload, and ``dask scheduler`` refuses two of those on one command
line. dask-gateway starts its schedulers with its own (``dask_gateway.scheduler_preload``,
with ``--dg-...`` arguments), and distributed hands every preload the same arguments.
This module takes none: its ``dask_setup(server)`` installs exactly what ``--preload
accelsched`` does with no arguments, with the options of dask config
(``accelsched.placement.*``, ``accelsched.guard.*``, or ``DASK_ACCELSCHED__...``
variables), beside any other preload; a bad config value stops it with one log line.
"""

from accelsched.deploy.install import dask_teardown
from accelsched.deploy.install import setup_server as dask_setup

__all__ = ["dask_setup", "dask_teardown"]
