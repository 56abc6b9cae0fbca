"""Moved to :mod:`accelsched.deploy.install`; this path is kept for existing imports."""

from accelsched.deploy.install import dask_setup, dask_teardown  # noqa: F401
