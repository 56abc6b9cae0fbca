"""Moved to :mod:`accelsched.observe.status_table`; this path is kept for existing imports."""

from accelsched.observe.status_table import render, snapshot  # noqa: F401
