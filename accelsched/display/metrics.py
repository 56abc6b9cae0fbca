"""Prometheus metrics, derived from accelsched's events.

distributed's scheduler serves ``prometheus_client``'s global registry at ``/metrics``
when ``prometheus_client`` is installed (``pip install "accelsched[metrics]"``), so these
collectors appear there beside distributed's own. They are fed from the PlacementPlugin's
``log_event`` hook, which sees every accelsched event the scheduler logs, the workers'
included: events stay the single source of truth. Without ``prometheus_client`` this
module does nothing.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from functools import lru_cache
from typing import Any

from accelsched import events
from accelsched.policy import timeouts

__all__ = ["count_event", "gpus_from", "stop_gpus"]


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


def count_event(msg: Mapping[str, Any]) -> None:
    """Count one accelsched event.

    Any client may log to the ``accelsched`` topic: only known actions and reasons
    become labels (each label is a series held for the process's life) and only
    non-negative numbers are counted, so a forged event can neither raise here nor
    grow the registry.
    """
    c = _collectors()
    if c is None:
        return
    action = msg.get("action")
    if not isinstance(action, str) or action not in events.ACTIONS:
        return
    # a burst of fallbacks comes as one event with its size (``count``)
    count = _number(msg.get("count", 1)) if action == events.FALLBACK else 1
    c["events"].labels(action=action).inc(count if count is not None else 1)
    if action == events.FALLBACK:
        reason = msg.get("reason")
        reason = reason if isinstance(reason, str) and reason in _REASONS else "other"
        c["fallback_wait"].labels(reason=reason).observe(_number(msg.get("waited", 0)) or 0)
    elif action == events.LEAK:
        c["leaked"].observe(_number(msg.get("nbytes", 0)) or 0)


#: The fallback reasons :mod:`accelsched.policy.timeouts` gives; any other is ``"other"``.
_REASONS = frozenset(
    {
        timeouts.TIMEOUT,
        timeouts.NO_GPU_CAPACITY,
        timeouts.UNSATISFIABLE,
        timeouts.CHAIN,
        timeouts.OOM,
    }
)


def _number(value: Any) -> float | None:
    """A finite, non-negative number from an event, or None (an int too large for a
    float, NaN and infinity compare outside the range)."""
    plain = isinstance(value, (int, float)) and not isinstance(value, bool)
    return float(value) if plain and 0 <= value <= sys.float_info.max else None


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
