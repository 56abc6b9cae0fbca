"""Clusters started the way a script or notebook starts one: the scheduler in this
process (``SpecCluster``), two single-thread ``Nanny`` workers with one simulated GPU
each.

The overhead benchmark's second configuration, beside :mod:`benchmarks.micro.cli_cluster`:
a fresh cluster per round, the workers' CPU time read from their processes.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

from distributed import Client, Nanny, Scheduler, SpecCluster


@contextlib.contextmanager
def _quiet_workers() -> Iterator[None]:
    """Worker processes that log errors only, as the command-line clusters do: they set
    up logging on import, before a nanny's ``env`` or dask config reaches them, so the
    environment they inherit says it."""
    key = "DASK_DISTRIBUTED__LOGGING__DISTRIBUTED"
    saved = os.environ.get(key)
    os.environ[key] = "error"
    try:
        yield
    finally:
        if saved is None:
            del os.environ[key]
        else:
            os.environ[key] = saved


@contextlib.contextmanager
def in_process_cluster(label: str) -> Iterator[Client]:
    """A scheduler in this process and two single-thread ``Nanny`` workers, one
    simulated GPU each (``CUDA_VISIBLE_DEVICES`` in the worker's environment)."""
    workers = {
        f"{label}-{device}": {
            "cls": Nanny,
            "options": {
                "nthreads": 1,
                "resources": {"GPU": 1},
                "env": {"CUDA_VISIBLE_DEVICES": device},
                "dashboard": False,
            },
        }
        for device in ("0", "1")
    }
    scheduler = {"cls": Scheduler, "options": {"dashboard_address": ":0"}}
    with (
        _quiet_workers(),
        SpecCluster(workers=workers, scheduler=scheduler, silence_logs=logging.ERROR) as cluster,
        Client(cluster) as client,
    ):
        client.wait_for_workers(2, timeout=60)
        yield client
