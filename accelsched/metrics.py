"""Prometheus metrics, derived from accelsched's events.

distributed's scheduler serves ``prometheus_client``'s global registry at ``/metrics``
when ``prometheus_client`` is installed (``pip install "accelsched[metrics]"``), so these
collectors appear there beside distributed's own. They are fed from the PlacementPlugin's
``log_event`` hook, which sees every accelsched event the scheduler logs, the workers'
included: events stay the single source of truth. Without ``prometheus_client`` this
module does nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import lru_cache
from typing import Any

__all__ = ["observe", "gpus_from", "stop_gpus"]


@lru_cache(maxsize=1)
def _collectors() -> dict[str, Any] | None:
    """Create the collectors once per process (the registry refuses duplicates)."""
    try:
        import prometheus_client as pc
    except ImportError:
        return None
    return {
        "events": pc.Counter(
            "accelsched_events", "accelsched events logged, by action", ["action"]
        ),
        "fallback_wait": pc.Histogram(
            "accelsched_fallback_wait_seconds",
            "Seconds a GPU task waited unplaced before its CPU form ran",
            ["reason"],
            buckets=(0.0, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 300, float("inf")),
        ),
        "leaked": pc.Histogram(
            "accelsched_leak_bytes",
            "Device bytes a confirmed leak held",
            buckets=tuple(2.0**k for k in range(20, 38, 2)) + (float("inf"),),
        ),
        "gpus": pc.Gauge("accelsched_gpus", "GPUs in the cluster, by state", ["state"]),
    }


def observe(msg: Mapping[str, Any]) -> None:
    """Count one accelsched event."""
    c = _collectors()
    if c is None:
        return
    action = msg.get("action", "unknown")
    # a burst of fallbacks comes as one event with its size (``count``)
    c["events"].labels(action=action).inc(msg.get("count", 1) if action == "fallback" else 1)
    if action == "fallback":
        c["fallback_wait"].labels(reason=msg.get("reason", "")).observe(msg.get("waited", 0))
    elif action == "leak":
        c["leaked"].observe(msg.get("nbytes", 0))


#: What the GPU gauge reads now (the registry is the process's: one source at a time).
_gauge_source: list[Callable[[], tuple[int, int]]] = []


def gpus_from(count: Callable[[], tuple[int, int]]) -> None:
    """Serve the GPU gauge from ``count()`` -> (verified, quarantined), read at scrape
    time: registering the 200th worker costs what registering the first did."""
    c = _collectors()
    if c is None:
        return
    _gauge_source[:] = [count]
    c["gpus"].labels(state="verified").set_function(lambda: count()[0])
    c["gpus"].labels(state="quarantined").set_function(lambda: count()[1])


def stop_gpus(count: Callable[[], tuple[int, int]]) -> None:
    """``count`` stops serving the gauge (its plugin was unregistered or its scheduler
    closed): the gauge reads 0 rather than a gone plugin's grants, and holds it no more.
    Nothing changes when another source took over since."""
    c = _collectors()
    if c is None or _gauge_source != [count]:
        return
    _gauge_source.clear()
    for state in ("verified", "quarantined"):
        c["gpus"].labels(state=state).set_function(lambda: 0)
