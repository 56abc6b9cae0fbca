"""What the scheduler holds about each worker's GPUs, and what the guards report of them.

Workers register before their plugins run, so what a worker declares counts for nothing
until its guard has verified its devices. Per worker address :class:`Grants` keeps one
:class:`WorkerGrant`: the devices granted (one owner per GPU UUID, :meth:`Grants.claim`:
the owners are these grants, kept nowhere else), the UUIDs it was refused, the ``GPU``
count it registered with (put back on unregister), the count its guard offers now, and its
quarantine. From these follow the counts placement may use (:meth:`Grants.placed`).
:class:`Grants` talks to nothing: :class:`DeviceReports` (below) and the placement plugin
change it through its methods, and readers (the status snapshot) get the worker's
record, which is never changed in place.

:class:`DeviceReports` serves ``accelsched_inventory`` and ``accelsched_offer``.

A worker's guard reports the devices it verified and the count it asks for; this part
grants what nobody else owns (:class:`Grants`), logs the
verdict (``gpu-verified``, ``gpu-rejected``, ``gpu-corrected``) and answers with the UUIDs
granted. Later the guard offers how many of them it can serve now (fewer while one is
withdrawn), and placement follows (below).

Every request from a worker (these two, and ``accelsched_restart``) is acted on only if
the process it comes from is the one the scheduler holds at the address it names, and
only once per id (:class:`~accelsched.policy.requests.Requests`; :meth:`DeviceReports.admits`):
a late request from a process since replaced, or one replayed, is refused and logged as a
``request-refused`` event. The threat model is distributed's (docs/architecture.md):
anyone connected is trusted; what is guarded against are accidents. When a worker
leaves, the workers refused one of its GPUs are asked to report again, so a GPU whose
owner left does not sit unused.

Each worker's ``GPU`` count in distributed's placement is what :class:`Grants` allows. A
declared ``GPU`` resource is live in distributed before anything has checked it, and
anyone can call ``set_resources`` naming any worker. So the count is stripped at
registration, set within the grant whenever the worker's guard offers (or anyone calls
``set_resources``), zero while the worker is quarantined, and back to the declaration when
the plugin is unregistered. A worker whose count grows is offered the ``no-worker`` tasks
(distributed does not); one whose count shrinks sends back what no longer fits.

What the cluster's GPUs look like now, and lately (:class:`StatusHistory`): for
``accelsched status`` and the dashboard page.

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

import logging
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from distributed.metrics import time as _now  # the event log's clock

from accelsched import events, internals
from accelsched.policy.requests import Requests, grant
from accelsched.policy.requirements import (
    DeviceFacts,
    MiB,
    capability_of,
    capacity,
    share,
)
from accelsched.protocol import (
    GPU,
    GPU_MEMORY,
    GUARD_METRIC,
    GUARD_PLUGIN,
    INT_LIMIT,
    INVENTORY_HANDLER,
    OFFER_HANDLER,
    REPORT_HANDLER,
    STATUS_HANDLER,
    DeviceRecord,
    DeviceStatus,
    InventoryReply,
    OfferReply,
    StatusReply,
    WorkerStatus,
    report_problem,
)

if TYPE_CHECKING:
    from distributed import Scheduler
    from distributed.scheduler import WorkerState

__all__ = [
    "DeviceReports",
    "Grants",
    "WorkerGrant",
    "facts_of",
    "StatusHistory",
    "Marker",
    "Sample",
    "STATUS_VERSION",
]

logger = logging.getLogger(__name__)


def facts_of(record: DeviceRecord) -> DeviceFacts:
    """A granted device as requirements see it (a guard's report, checked types)."""
    return DeviceFacts(
        str(record["name"]),
        int(record["memory"]),
        capability_of(record.get("capability")),
        record.get("mig") is True,
    )


@dataclass(frozen=True)
class WorkerGrant:
    """One worker's GPUs as the scheduler holds them: one record per worker address,
    replaced whole on every change, so a reader may keep it (the device records are
    the grant's own: a reader copies what it keeps)."""

    devices: tuple[DeviceRecord, ...] = ()  # granted, in the order its guard reported them
    reported: bool = False  # its guard reported (its grant may be empty)
    refused: frozenset[str] = frozenset()  # UUIDs it was refused
    declared: float | None = None  # the GPU count it registered with; None: declared none
    offered: int = 0  # granted GPUs its guard offers now
    named: frozenset[str] | None = None  # which ones; None: it did not say
    held: Mapping[str, int] = field(default_factory=dict)  # UUID -> bytes results hold on it
    #: UUID -> bytes its guard says its tasks and results may take there now: the share it
    #: packs within, or more while tasks packed under a larger one still run
    packs: Mapping[str, int] = field(default_factory=dict)
    told: Mapping[str, int] = field(default_factory=dict)  # UUID -> the share last told it
    quarantined: str | None = None  # why its GPUs are out of placement; None: they are not
    quarantined_in: str | None = None  # the worker process quarantined (its server id)


class Grants:
    """Grants, ownership, declarations, offers and quarantine: a :class:`WorkerGrant` per
    worker address."""

    def __init__(self, *, share_gpus: bool) -> None:
        self.share_gpus = share_gpus  # more than one worker may drive a GPU UUID
        self._workers: dict[str, WorkerGrant] = {}

    # --- reading -----------------------------------------------------------------------

    def of(self, worker: str) -> WorkerGrant:
        return self._workers.get(worker, _NOTHING)

    def _set(self, worker: str, **changes: Any) -> None:
        self._workers[worker] = replace(self.of(worker), **changes)

    def uuids(self, worker: str) -> list[str]:
        """The UUIDs granted to ``worker``, in its guard's order (the inventory reply)."""
        return [d["uuid"] for d in self.of(worker).devices]

    def placed(self, worker: str) -> int:
        """The GPU count placement uses: what the guard offers, within the grant (0 while
        quarantined)."""
        g = self.of(worker)
        return 0 if g.quarantined is not None else min(g.offered, len(g.devices))

    def gauge(self) -> tuple[int, int]:
        """(GPUs placement may use, GPUs of quarantined workers): the metrics gauge."""
        granted = [(len(g.devices), g.quarantined is not None) for g in self._workers.values()]
        return sum(n for n, q in granted if not q), sum(n for n, q in granted if q)

    # --- declarations --------------------------------------------------------------------

    def declare(self, worker: str, count: float, *, correct: bool = False) -> None:
        """``worker`` registered declaring ``count`` GPUs (the first word stands); or,
        ``correct``, the worker's own word on what it was started with (a plugin
        registered after an earlier one found the count that one had corrected)."""
        if (self.of(worker).declared is None) != correct:
            self._set(worker, declared=count)

    # --- grants ----------------------------------------------------------------------------

    def claim(
        self, worker: str, wanted: list[DeviceRecord]
    ) -> tuple[list[DeviceRecord], dict[str, str]] | None:
        """Grant ``worker`` the devices of ``wanted`` nobody else owns: one owner per GPU
        UUID unless ``share_gpus`` (:func:`~accelsched.policy.requests.grant`). Returns
        them and the refused UUIDs with their owners (None: a repeated report, nothing
        changed)."""
        previous, uuids = self.of(worker), [d["uuid"] for d in wanted]
        if previous.reported and not previous.refused and self.uuids(worker) == uuids:
            return None
        owners = {  # its own previous grant stands in nobody's way
            d["uuid"]: w for w, g in self._workers.items() if w != worker for d in g.devices
        }
        kept, refused = grant(uuids, owners, share=self.share_gpus)
        granted = [d for d in wanted if d["uuid"] in kept]
        self._set(worker, devices=tuple(granted), reported=True, refused=frozenset(refused))
        return granted, refused

    def offer(
        self,
        worker: str,
        count: int,
        uuids: list[str] | None = None,
        held: dict[str, int] | None = None,
        packs: dict[str, int] | None = None,
    ) -> None:
        """``worker``'s guard offers ``count`` of its granted GPUs now: those of ``uuids``
        (None: it did not say which); ``held``: bytes its results hold on each; ``packs``:
        bytes its tasks and results may take on each as it stands."""
        named = None if uuids is None else frozenset(uuids)
        held, packs = dict(held or {}), dict(packs or {})
        self._set(worker, offered=count, named=named, held=held, packs=packs)

    def tell(self, worker: str, shares: dict[str, int]) -> None:
        """``worker``'s guard is told ``shares`` (the offer reply)."""
        self._set(worker, told=shares)

    def untold(self, worker: str) -> list[str]:
        """The workers sharing a device with ``worker`` whose share is no longer what
        they were told (``worker`` took or gave back room there)."""
        return [
            other
            for other in sorted(self.sharers(worker))
            if self.of(other).reported
            and self.shares(other, self.placed(other))[0] != self.of(other).told
        ]

    def sharers(self, worker: str) -> set[str]:
        """The other workers granted one of ``worker``'s devices (``share_gpus``; without
        it a device has one owner, and nothing is looked through)."""
        if not self.share_gpus:
            return set()
        mine = set(self.uuids(worker))
        return {w for w in self._workers if w != worker and mine & set(self.uuids(w))}

    def shares(self, worker: str, count: int) -> tuple[dict[str, int], int]:
        """The bytes ``worker``'s declared tasks may take on each of its first ``count``
        offered devices, and the ``GPU-memory`` (MiB) to place against: those less what
        results hold. The offered devices are those its guard named, else the first ones.

        A device's capacity is divided among the workers granted it, and never more
        than what the others leave: each may take the share it was told, or what its
        guard last said it may take, whichever is more. A sharer told a smaller share
        takes more until its guard says it packs within it (its tasks packed under the
        larger one have ended), so room passes from one worker to another only once
        the first has let go of it."""
        g = self.of(worker)
        # workers granted each device: one without share_gpus (no look over the cluster)
        owners: Counter[str] = (
            Counter(d["uuid"] for o in self._workers.values() for d in o.devices)
            if self.share_gpus
            else Counter()
        )
        offered = (
            g.devices[: g.offered]
            if g.named is None
            else [d for d in g.devices if d["uuid"] in g.named]
        )
        mine: dict[str, int] = {}
        for d in offered[:count]:
            uuid, memory = d["uuid"], int(d["memory"])
            mine[uuid] = share(memory, owners[uuid] or 1)
            if owners[uuid] > 1:
                taken = sum(
                    max(o.told.get(uuid, 0), o.packs.get(uuid, 0))
                    for w, o in self._workers.items()
                    if w != worker and any(r["uuid"] == uuid for r in o.devices)
                )
                mine[uuid] = max(0, min(mine[uuid], capacity(memory) - taken))
        # whole MiB, rounded down: a need placed here (rounded up) fits what the guard
        # packs against, byte for byte (else it is sent back, again and again)
        return mine, sum(max(0, b - g.held.get(u, 0)) // MiB for u, b in mine.items())

    def quarantine(self, worker: str, reason: str, process: str | None = None) -> bool:
        """Note ``worker``'s quarantine (``process``: its server id); False when it was
        quarantined already."""
        if self.of(worker).quarantined is not None:
            return False
        self._set(worker, quarantined=reason, quarantined_in=process)
        return True

    def quarantines(self) -> list[tuple[str, str, str | None]]:
        """(worker, reason, process) of each quarantined worker."""
        return [
            (w, g.quarantined, g.quarantined_in)
            for w, g in self._workers.items()
            if g.quarantined is not None
        ]

    def remove(self, worker: str) -> list[str]:
        """Forget ``worker`` (it left) and free its GPUs; returns the other workers that
        were refused one of them, which may claim it now."""
        freed = {d["uuid"] for d in self._workers.pop(worker, _NOTHING).devices}
        return [other for other, g in self._workers.items() if g.refused & freed]


#: A worker nothing is held of.
_NOTHING = WorkerGrant()


class DeviceReports:
    """Serves the inventory and offer handlers; asks guards to report; sets the GPU count
    of every worker from its grant."""

    def __init__(
        self,
        scheduler: Scheduler,
        *,
        grants: Grants,
        emit: Callable[..., None],
        active: Callable[[], bool],
        gained: Callable[[str], None],
    ) -> None:
        """Gate ``set_resources``, strip every worker's declared GPUs,
        serve the handlers.

        ``gained(worker)``: the worker's devices were granted (tasks with requirements
        it meets gain it)."""
        self.scheduler = scheduler
        self._grants = grants
        self._requests = Requests()
        self._emit = emit
        self._active = active
        self._gained = gained
        internals.wrap_handler(scheduler, "set_resources", self.set_resources)
        for ws in list(scheduler.workers.values()):
            self.add_worker(ws)
        internals.install_handler(scheduler, INVENTORY_HANDLER, self.handle_inventory)
        internals.install_handler(scheduler, OFFER_HANDLER, self.handle_offer)
        # guards already running report again now that someone listens (a guard
        # registered later reports from its own setup)
        self.ask_guards()

    def ask_guards(self) -> None:
        """Ask the guards to report: every worker when the guard is registered through
        the scheduler, else those whose heartbeat carries a guard's metric (``dask worker
        --preload accelsched``)."""
        scheduler = self.scheduler
        everyone = internals.worker_plugin_registered(scheduler, GUARD_PLUGIN)
        for addr, ws in list(scheduler.workers.items()):
            if everyone or internals.worker_metric(ws, GUARD_METRIC) is not None:
                internals.spawn(scheduler, self._ask_report, addr)

    def stop(self) -> None:
        """Unregistered: distributed's handlers and ``set_resources``, and every worker's
        GPU count as it was declared."""
        internals.remove_handler(self.scheduler, INVENTORY_HANDLER, self.handle_inventory)
        internals.remove_handler(self.scheduler, OFFER_HANDLER, self.handle_offer)
        internals.restore_handler(self.scheduler, "set_resources")
        for addr, ws in list(self.scheduler.workers.items()):
            if (count := self._grants.of(addr).declared) is not None:
                internals.set_worker_gpus(self.scheduler, ws, count)

    def remove_worker(self, worker: str) -> None:
        """Free the worker's GPUs (workers refused one of them, or sharing one, are asked
        to report again: they may claim it, or take a larger share of it); the request
        ids of its process go with it."""
        self._requests.forget(worker)
        sharers = self._grants.sharers(worker)
        for other in sorted(sharers.union(self._grants.remove(worker))):
            self._reshare(other)

    def _reshare(self, worker: str) -> None:
        """``worker``'s share of a device changed (a sharer joined or left): place
        against it now, and ask its guard to report, learning it from the offer reply."""
        if (ws := self.scheduler.workers.get(worker)) is not None:
            if self._grants.of(worker).reported:
                self.place(ws)
            internals.spawn(self.scheduler, self._ask_report, worker)

    def admits(self, worker: str, process: Any, request: Any, handler: str) -> bool:
        """Whether to act on ``request`` to ``handler``, naming ``worker``, from
        ``process`` (a worker unknown here: no, and no event; its handler says so)."""
        ws = self.scheduler.workers.get(worker)
        registered = None if ws is None else ws.server_id
        refusal = self._requests.refusal(worker, process, registered, request)
        if refusal is not None and ws is not None:
            self._emit(events.REQUEST_REFUSED, worker, handler=handler, reason=refusal)
        return refusal is None

    async def _ask_report(self, addr: str) -> None:
        if (ws := self.scheduler.workers.get(addr)) is None or internals.closing(ws):
            return  # closing (a whole cluster closes, one sharer after another): no guard
        try:
            await getattr(self.scheduler.rpc(addr), REPORT_HANDLER)()
        except Exception as exc:  # a worker without the GuardPlugin, or gone
            logger.debug("accelsched: %s did not report its GPUs: %r", addr, exc)

    # --- the inventory handler -----------------------------------------------------------

    def handle_inventory(
        self,
        comm: Any,
        worker: str,
        devices: list[DeviceRecord],
        process: str = "",
        request: str = "",
        declared: float | None = None,
        requested: int = 0,
        reason: str | None = None,
    ) -> InventoryReply:
        """A guard reports the devices it verified and the count it asks for.

        Grants a subset when another worker owns some. Idempotent: a repeated, unchanged
        report changes nothing and logs nothing.
        """
        if not self._active():
            return {"status": "no-plugin"}
        if worker not in self.scheduler.workers:
            return {"status": "unknown-worker"}
        if not self.admits(worker, process, request, INVENTORY_HANDLER):
            return {"status": "refused"}
        if (problem := report_problem(devices, requested)) is not None:  # nothing granted
            logger.warning("accelsched: refused the GPU report of %s: %s", worker, problem)
            return {"status": "refused"}
        if isinstance(declared, (int, float)):
            self._grants.declare(worker, declared, correct=True)
        # a repeated, unchanged report: nothing
        if (claimed := self._grants.claim(worker, devices[:requested])) is not None:
            granted, refused = claimed
            for other in sorted(self._grants.sharers(worker)):  # its share of theirs is less now
                self._reshare(other)
            if granted:
                self._emit(events.GPU_VERIFIED, worker, devices=granted, granted=len(granted))
            if refused:
                owners = sorted(set(refused.values()))
                self._emit(
                    events.GPU_REJECTED,
                    worker,
                    uuids=sorted(refused),
                    reason="owned",
                    owner=owners[0] if len(owners) == 1 else owners,
                )
            if declared != len(granted) and (reason is not None or refused):
                self._emit(
                    events.GPU_CORRECTED,
                    worker,
                    declared=declared,
                    granted=len(granted),
                    reason="owned" if refused else reason,
                )
        reply: InventoryReply = {"status": "OK", "uuids": self._grants.uuids(worker)}
        if self._grants.of(worker).quarantined is not None:
            reply["draining"] = True
        return reply

    # --- the offer handler -----------------------------------------------------------------

    def handle_offer(
        self,
        comm: Any,
        worker: str,
        process: str = "",
        request: str = "",
        count: Any = 0,
        uuids: Any = None,
        held: Any = None,
        packs: Any = None,
    ) -> OfferReply:
        """A guard offers ``count`` of its granted GPUs (fewer while one is withdrawn):
        those of ``uuids``, whose results hold ``held`` bytes on each, and whose tasks
        and results may take ``packs`` bytes on each. The reply says the share of each
        device its declared tasks may take; the workers sharing one whose share this
        changed are asked to offer again, to learn theirs."""
        if not self._active():
            return {"status": "no-plugin", "count": 0}
        ws = self.scheduler.workers.get(worker)
        if ws is None:
            return {"status": "unknown-worker", "count": 0}
        valid = (
            type(count) is int
            and count >= 0
            and (  # a list sent, a tuple as distributed's msgpack reads it, of granted
                # devices, as many as it offers
                uuids is None
                or isinstance(uuids, (list, tuple))
                and all(isinstance(u, str) for u in uuids)
                and len(set(uuids)) == count
                and set(uuids) <= set(self._grants.uuids(worker))
            )
            and all(  # bytes per offered (else granted) device
                said is None
                or isinstance(said, dict)
                and all(type(n) is int and n >= 0 for n in said.values())
                and set(said) <= set(self._grants.uuids(worker) if uuids is None else uuids)
                for said in (held, packs)
            )
        )
        if not valid:
            return {"status": "invalid", "count": 0}
        if not self.admits(worker, process, request, OFFER_HANDLER):
            return {"status": "refused", "count": 0}
        self._grants.offer(worker, count, None if uuids is None else list(uuids), held, packs)
        self.place(ws)
        placed = self._grants.placed(worker)
        shares, memory = self._grants.shares(worker, placed)
        self._grants.tell(worker, shares)
        for other in self._grants.untold(worker):
            self._reshare(other)
        return {"status": "OK", "count": placed, "shares": shares, "memory": memory}

    # --- the GPU count placement uses ----------------------------------------------------

    def add_worker(self, ws: WorkerState) -> None:
        """The declared count does not count: nothing reaches the worker on its word.

        A worker that declared no GPU stays out of the ``GPU`` resource altogether (a
        ``GPU: 0`` entry would make it valid for ``resources={"GPU": 0}`` tasks, which its
        own state machine cannot run).
        """
        if GPU not in ws.resources:
            return
        self._grants.declare(ws.address, ws.resources[GPU])
        internals.set_worker_gpus(self.scheduler, ws, self._grants.placed(ws.address))

    def place(self, ws: WorkerState) -> None:
        """Set the worker's GPU count to what its grant places; offer or send back tasks."""
        if not (after := self._grants.placed(ws.address)) and GPU not in ws.resources:
            return  # never declared, nothing granted: stays out of the GPU resource
        before = ws.resources.get(GPU, 0)
        had = ws.resources.get(GPU_MEMORY, 0)
        internals.set_worker_gpus(self.scheduler, ws, after)
        # declared-memory tasks take GPU-memory: the offered devices' shares (their
        # capacity, divided among the workers sharing one) less what results hold
        memory = self._grants.shares(ws.address, after)[1]
        internals.set_worker_gpus(self.scheduler, ws, memory, GPU_MEMORY)
        if after > before:  # waiting tasks, and its share of its peers' queues
            self._gained(ws.address)  # tasks with requirements it meets
            internals.offer_unrunnable(self.scheduler, ws)
            internals.take_share(self.scheduler, ws)
        elif after < before or memory < had:  # what no longer fits goes elsewhere
            internals.release_unfit(self.scheduler, ws)
        if after == before and memory > had:  # results released, a sharer left
            internals.offer_unrunnable(self.scheduler, ws)

    def set_resources(
        self, original: Callable[..., Any], worker: str, resources: dict | None = None
    ) -> Any:
        """distributed's ``set_resources`` handler; the GPU figure is the grant's.

        Anyone can call ``set_resources`` naming any worker, so a ``GPU`` value in it
        counts for nothing: placement uses what the worker's guard offered (confirmed)
        within its grant. Other resources pass through.
        """
        ws = self.scheduler.workers.get(worker)
        if ws is None or not self._active():  # unregistered: distributed's own behaviour
            return original(worker=worker, resources=resources)
        theirs = {k: v for k, v in (resources or {}).items() if k not in (GPU, GPU_MEMORY)}
        ours = {k: v for k, v in ws.resources.items() if k in (GPU, GPU_MEMORY)}  # as set here
        result = internals.apply_resources(original, self.scheduler, worker, {**theirs, **ours})
        self.place(ws)
        return result


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
        # the workers' names, the event log replayed; serve the status handler, sample
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
        name = self.names.get(worker) if isinstance(worker := msg.get("worker"), str) else None
        if (counted := _COUNTED.get(action)) is not None:
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
        and (d.get("leak_estimate") is None or _integer(d["leak_estimate"], least=1 - INT_LIMIT))
    }
    return out, len(out) == len(devices)


def _integer(value: Any, least: int = 0) -> bool:
    """An int from ``least`` on that a reader can turn into a float (a byte count, a lease
    count; a leak estimate may be negative)."""
    return isinstance(value, int) and not isinstance(value, bool) and least <= value < INT_LIMIT
