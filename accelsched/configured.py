"""``--preload accelsched.configured``: the plugins, options from dask config only.

``--preload accelsched`` takes preload arguments, so distributed counts it as a
"click-configurable" preload, and ``dask scheduler`` refuses two of those on one command
line. dask-gateway starts its schedulers with its own (``dask_gateway.scheduler_preload``,
with ``--dg-...`` arguments), and distributed hands every preload the same arguments.
This module takes none: it installs exactly what ``--preload accelsched`` does, with the
options of dask config (``accelsched.placement.*``, ``accelsched.guard.*``, or
``DASK_ACCELSCHED__...`` variables), beside any other preload.
"""

from __future__ import annotations

from typing import Any

from accelsched.deploy.install import setup_server

__all__ = ["dask_setup", "dask_teardown"]


async def dask_setup(server: Any) -> None:
    """Install the plugins on ``server`` (scheduler or worker), as ``--preload accelsched``
    does with no arguments; a bad config value stops it with one log line."""
    await setup_server(server)


def dask_teardown(server: Any) -> None:
    """Nothing to undo: the servers close and tear down their plugins themselves."""
