"""Moved to :mod:`accelsched.deploy.forked_workers`; this path is kept for existing imports."""

from accelsched.deploy.forked_workers import FastRestart  # noqa: F401
