"""Moved to :mod:`accelsched.scheduler.placement_plugin`; this path is kept for existing imports."""

from accelsched.scheduler.placement_plugin import PlacementPlugin  # noqa: F401
