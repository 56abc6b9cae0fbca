"""The ``accelsched`` command: ``demo``, ``status``, ``events``, ``simulate``, ``version``."""

from accelsched.cli.main import main

__all__ = ["main"]
