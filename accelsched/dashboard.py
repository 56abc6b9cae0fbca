"""Moved to :mod:`accelsched.observe.dashboard_page`; this path is kept for existing imports."""

from accelsched.observe.dashboard_page import install  # noqa: F401
