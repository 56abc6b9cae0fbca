"""What the cluster's GPUs look like now, and lately: for ``accelsched status`` and the
dashboard page.

One snapshot (:class:`~accelsched.protocol.StatusReply`) serves both. It joins what the
scheduler side already holds (its grants, declarations and quarantine) with what
only each worker knows (leases in use, the leak estimate and its threshold), which rides
on the workers' heartbeats as a custom metric (:mod:`accelsched.worker.leak_check`). Counts
of restarts, leaks, reclaimed leaks and fallbacks come from the events (the single
source), fed by the PlacementPlugin's ``log_event`` hook and replayed from the event log
at start, so a re-registered plugin counts what happened before it.

Workers are shown by name: a worker restarted through its nanny comes back at a new
address under the same name, and its counts and history carry on.

Memory is bounded: :data:`HISTORY_SECONDS` of samples, one every
:data:`SAMPLE_SECONDS`, per (worker name, device) (three numbers each; series of workers
gone longer than the window are dropped), :data:`MAX_MARKERS` event markers,
:data:`MAX_FALLBACKS` fallback times, and :data:`MAX_NAMES` address -> name entries and
per-worker counts.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from distributed.metrics import time as _now  # the event log's clock

from accelsched import events, internals
from accelsched.protocol import (
    GPU,
    GUARD_METRIC,
    GUARD_PLUGIN,
    STATUS_HANDLER,
    DeviceStatus,
    StatusReply,
    WorkerStatus,
)
from accelsched.scheduler.fallback import facts_of
from accelsched.scheduler.grants import Grants

if TYPE_CHECKING:
    from distributed import Scheduler
    from distributed.scheduler import WorkerState

__all__ = ["StatusHistory", "Marker", "Sample", "STATUS_VERSION"]

#: ``StatusReply.version``: raised only when a field changes meaning or goes away.
STATUS_VERSION = 1
HISTORY_SECONDS = 600.0
SAMPLE_SECONDS = 1.0
MAX_MARKERS = 1000
MAX_FALLBACKS = 1000
MAX_NAMES = 4096
#: Events drawn as markers on the dashboard's time lines.
MARKED = frozenset({events.LEAK, events.RESTART, events.QUARANTINE, events.GPU_UNHEALTHY})
_COUNTED = {
    events.RESTART: "restarts",
    events.LEAK: "leaks",
    events.LEAK_RECLAIMED: "reclaims",
    events.FALLBACK: "fallbacks",
}
_PERIODIC = "accelsched-status-history"
#: A granted device's figures while its guard has not reported them (:func:`_figures`).
_UNKNOWN: dict[str, Any] = {
    "declared": None,
    "leases": None,
    "withdrawn": False,
    "leak_estimate": None,
    "leak_threshold": None,
}


class Sample(NamedTuple):
    time: float
    estimate: int | None
    threshold: int | None


class Marker(NamedTuple):
    time: float
    worker: str | None  # name
    device: int | None
    action: str
    nbytes: int | None  # a leak's estimate


class StatusHistory:
    """What `accelsched status` and the dashboard show: worker names, event counts, the
    snapshot, and its bounded history."""

    def __init__(
        self,
        scheduler: Scheduler,
        grants: Grants,
        waiting: Callable[[], dict[str, list[Any]]],
        options: dict[str, Any],
        pool_of: Callable[[str], str | None],
    ) -> None:
        # the PlacementPlugin's options; GPU tasks unplaced, by reason (scheduler/fallback.py);
        # a worker's elastic pool, by its name (scheduler/fallback.py)
        self._grants, self._options, self._waiting = grants, dict(options), waiting
        self._pool_of = pool_of
        self.scheduler = scheduler
        self.names: OrderedDict[str, str] = OrderedDict()  # address -> worker name
        self.counts: dict[str, Counter[str]] = {}  # worker name -> counted events
        self.totals: Counter[str] = Counter()
        self.series: dict[tuple[str, int], deque[Sample]] = {}
        self.markers: deque[Marker] = deque(maxlen=MAX_MARKERS)
        self.fallbacks: deque[tuple[float, int]] = deque(maxlen=MAX_FALLBACKS)  # cumulative

    # --- wiring ------------------------------------------------------------------------

    def start(self) -> None:
        """Learn the workers' names, replay the event log, serve the status handler and
        start sampling."""
        for ws in list(self.scheduler.workers.values()):
            self.add_worker(ws)
        for stamp, msg in self.scheduler.get_events(events.TOPIC):
            if isinstance(msg, dict):
                self.record_event(msg, stamp)
        internals.install_handler(self.scheduler, STATUS_HANDLER, self.snapshot)
        internals.start_periodic(self.scheduler, _PERIODIC, self.sample, SAMPLE_SECONDS)

    def stop(self) -> None:
        """Unregistered or closing: no handler, no sampling (the history stays readable)."""
        internals.remove_handler(self.scheduler, STATUS_HANDLER, self.snapshot)
        internals.stop_periodic(self.scheduler, _PERIODIC)

    def add_worker(self, ws: WorkerState) -> None:
        self.names[ws.address] = str(ws.name)
        self.names.move_to_end(ws.address)
        while len(self.names) > MAX_NAMES:
            self.names.popitem(last=False)

    def record_event(self, msg: dict[str, Any], stamp: float | None = None) -> None:
        """One accelsched event (from ``log_event``, or replayed with its time)."""
        action = msg.get("action")
        if not isinstance(action, str) or action not in events.ACTIONS:
            return
        when = stamp if stamp is not None else _now()
        # any client may log to the topic: only a worker we know has a row to count in
        # (an unknown or unhashable "worker" would grow ``counts`` or raise here)
        worker = msg.get("worker")
        name = self.names.get(worker) if isinstance(worker, str) else None
        counted = _COUNTED.get(action)
        if counted is not None:
            # a burst of fallbacks is one event with its size
            n = msg.get("count", 1) if action == events.FALLBACK else 1
            n = n if isinstance(n, int) and n > 0 else 1
            self.totals[counted] += n
            if name is not None:
                self.counts.setdefault(name, Counter())[counted] += n
                while len(self.counts) > MAX_NAMES:  # the oldest names go first
                    del self.counts[next(iter(self.counts))]
        if action == events.FALLBACK:
            self.fallbacks.append((when, self.totals["fallbacks"]))
        if action in MARKED:
            device, nbytes = msg.get("device"), msg.get("nbytes")
            self.markers.append(
                Marker(
                    when,
                    name,
                    device if isinstance(device, int) else None,
                    action,
                    nbytes if isinstance(nbytes, int) else None,
                )
            )

    # --- the snapshot --------------------------------------------------------------------

    def snapshot(self) -> StatusReply:
        """The ``accelsched_status`` reply: read-only; nothing ``scheduler_info`` does not
        reveal."""
        workers = sorted(
            (self._worker(ws) for ws in list(self.scheduler.workers.values())),
            # in a person's order: 2 before 10, numbers before words
            key=lambda w: (0, int(n), "") if (n := w["name"]).isdigit() else (1, 0, n),
        )
        return {
            "version": STATUS_VERSION,
            "time": _now(),
            "scheduler": self.scheduler.address,
            "guard": internals.worker_plugin_registered(self.scheduler, GUARD_PLUGIN),
            "workers": workers,
            "restarts": self.totals["restarts"],
            "leaks": self.totals["leaks"],
            "reclaims": self.totals["reclaims"],
            "fallbacks": self.totals["fallbacks"],
            "waiting": {reason: len(keys) for reason, keys in sorted(self._waiting().items())},
            "names": {**self.names, **{w["address"]: w["name"] for w in workers}},
            "options": dict(self._options),
        }

    def _worker(self, ws: WorkerState) -> WorkerStatus:
        metric = internals.worker_metric(ws, GUARD_METRIC)
        figures, whole = _figures(metric)
        # a granted device without figures waits for them while no metric has come since
        # the guard started, or the metric is whole and predates the grant; one whose
        # entry was left out of the metric is unreadable
        missing: Literal["waiting", "unreadable"] = (
            "waiting" if metric is None or whole else "unreadable"
        )
        grant = self._grants.of(ws.address)
        # the grant's record, then the guard's figures over "unknown" (one shape)
        devices: list[DeviceStatus] = [
            {
                "index": rec["index"],
                "uuid": rec["uuid"],
                "name": rec["name"],
                "memory": rec["memory"],
                "capability": None
                if (cc := facts_of(rec).capability) is None
                else "{}.{}".format(*cc),
                **figures.get(rec["index"], _UNKNOWN),  # type: ignore[typeddict-item]
                "figures": "reported" if rec["index"] in figures else missing,
            }
            for rec in grant.devices
        ]
        name = str(ws.name)
        counts = self.counts.get(name, Counter())
        return {
            "name": name,
            "pool": self._pool_of(name),
            "address": ws.address,
            "gpus": ws.resources.get(GPU, 0),
            "declared": grant.declared,
            "quarantined": grant.quarantined,
            "devices": devices,
            "restarts": counts["restarts"],
            "leaks": counts["leaks"],
            "reclaims": counts["reclaims"],
            "fallbacks": counts["fallbacks"],
        }

    # --- history, for the dashboard ------------------------------------------------------

    def sample(self) -> None:
        """Record every device's leak estimate and threshold now (periodic)."""
        now = _now()
        for w in self.snapshot()["workers"]:
            for d in w["devices"]:
                self.series.setdefault(
                    (w["name"], d["index"]), deque(maxlen=int(HISTORY_SECONDS / SAMPLE_SECONDS))
                ).append(Sample(now, d["leak_estimate"], d["leak_threshold"]))
        for key, series in list(self.series.items()):
            if not series or series[-1].time < now - HISTORY_SECONDS:
                del self.series[key]


def _figures(metric: Any) -> tuple[dict[int, dict[str, Any]], bool]:
    """The figures of the devices of a worker's heartbeat metric that are well formed, by
    index (the keys of :data:`_UNKNOWN`), and whether the metric is whole (every entry
    well formed).

    The metric is whatever the worker sent: a device entry of the wrong shape or with
    a figure of the wrong type is left out (shown as unknown), so one odd worker cannot
    break the status of the whole cluster nor pass odd values (or keys) on to its readers.
    """
    devices = metric.get("devices") if isinstance(metric, dict) else None
    if not isinstance(devices, (list, tuple)):
        return {}, False
    out = {
        d["index"]: {
            **{k: d.get(k) for k in ("leases", "withdrawn", "leak_estimate", "leak_threshold")},
            "declared": d["declared"] if _integer(d.get("declared")) else None,
        }
        for d in devices
        if isinstance(d, dict)
        and isinstance(d.get("withdrawn"), bool)
        and all(_integer(d.get(k)) for k in ("index", "leases", "leak_threshold"))
        and (d.get("leak_estimate") is None or _integer(d["leak_estimate"], least=1 - 2**63))
    }
    return out, len(out) == len(devices)


def _integer(value: Any, least: int = 0) -> bool:
    """An int from ``least`` on that a reader can turn into a float (a byte count, a lease
    count; a leak estimate may be negative)."""
    return isinstance(value, int) and not isinstance(value, bool) and least <= value < 2**63
