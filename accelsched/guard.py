"""Moved to :mod:`accelsched.worker.guard_plugin`; this path is kept for existing imports."""

from accelsched.worker.guard_plugin import GuardPlugin  # noqa: F401
