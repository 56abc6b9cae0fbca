"""The ``accelsched`` command (also ``dask accelsched``): ``demo``, ``status``, ``events``,
``simulate``, ``version``."""

from accelsched.cli.main import cli, main

__all__ = ["cli", "main"]
