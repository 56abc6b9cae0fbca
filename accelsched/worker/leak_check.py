"""The leak check: device memory that nothing legitimate holds, checked periodically.

Each check reads, through NVML, every owned device no GPU task holds: this process's
memory there, and the device's memory info (what pools and users read). It takes off
the baseline, live results (:meth:`Ledger.live`) and pool caches
(:func:`accelsched.policy.leak.estimate`), and lets
:class:`~accelsched.policy.leak.LeakDecisions` judge the estimates. Every decision comes
back as proposals, which one actor carries out
(:class:`WorkerActor`): read, decide, act. A confirmed leak
is reported once and, with ``restart_on_leak``, the worker asks for its own lossless
restart, unless collecting garbage and freeing the pools gave the memory back first:
then the devices are read again and the decisions say how it ended.

A device whose query raises has stopped answering; one that answers after failing may
come back. Whether either is news is :func:`~accelsched.policy.leak.judge_answers`'s to
say, with :class:`~accelsched.policy.leak.DeviceHealth` (shared with
the left-out devices' probation, so a device failing again needs a longer streak,
whichever way it was seen to fail): withdrawn once, offered again when it answers (with
``recover_gpus``); no restart is asked while it fails. A device this process left out
of its inventory (it did not answer then) is asked again on the same terms, with backoff,
and reported back to the scheduler until it is granted (:meth:`WorkerActor.rejoin`).

As in distributed's Active Memory Manager (policies suggest, one place acts), the
decisions only return :class:`~accelsched.policy.proposals.Proposal` objects;
:class:`WorkerActor` turns them into what the rest of the cluster sees: events in the
scheduler's log (their fields written in the order docs/events.md gives), devices
withdrawn from or offered again to placement, a garbage collection, a restart request.

What only the worker knows (leases in use, leak estimates) rides on distributed's own
heartbeat, not a new RPC loop: :meth:`LeakCheck.heartbeat_metric` is registered as a
custom worker metric (:data:`~accelsched.protocol.GUARD_METRIC`), and the scheduler finds
it in the worker's ``WorkerState``.

**The ledger** (:class:`Ledger`, :class:`Meter`): device memory accounted by
measurement, what each GPU task leaves on its device.

Knowing a result's device footprint from its type fails for every type nobody described
(a cudf frame, a torch tensor): such a result looks like a leak. So the guard measures.
Around a GPU task that holds its devices alone, it reads this process's device memory net
of pool caches; the growth is held against the key the task produced until that key is
released (and the type's own figure, when known, is a second source). What the run added
beyond its known result is its *residue*, the memory it left behind: attributed to its
prefix. Data arriving from a peer is measured the same way when its device is idle.

The ledger is also the one record of what each result in the worker's memory holds, and
of their sum per device (:meth:`Ledger.live`): legitimate, so the leak estimate takes it
off. Every task's result passes through :meth:`Ledger.entered` (worker event loop), so
the common cases cost a few comparisons: a result its GPU task measured is held at its
measurement without a look at its value, and an unmeasured number or string (what most
tiny tasks return) holds nothing on a device.

On a device with a context, not every run is measured: a prefix whose measured runs keep
leaving nothing is measured on a sample of its runs (:class:`~accelsched.policy.leak.
Backoff`). A run left unmeasured so takes no reading when its result's footprint is known
by type (a number, an array a rule describes); the unmeasured runs of one prefix since the
last reading on a device form a *stretch*, and the prefix's next measured run, or a run
returning a result of unknown type, reads from before the stretch: whatever any run of it
left is found then, attributed to the prefix.

**Reclaiming** (:func:`reclaim`). Device memory that nothing reachable holds but a
reference cycle does looks leaked to NVML until Python's cyclic collector runs, and for
old objects it runs rarely: an object that refers to itself, or a failed task's
exception, whose traceback keeps the task's frames and the device arrays in their locals
(distributed keeps the exception in a message that the traceback's frames refer to: a
cycle). :func:`reclaim` collects such garbage, returning its arrays to their pools, then
frees the pools. The worker's actor calls it on a confirmed leak's ``reclaim`` proposal;
the leak check then measures again (:class:`~accelsched.policy.leak.LeakDecisions`
decides).

**The inventory** (:class:`Inventory`): the worker's verified devices, whose health and
leaks the check judges, and what it says to the scheduler about itself.

At setup the guard probes the devices through NVML (MIG devices included, as CUDA
enumerates them: :mod:`accelsched.devices`), decides which this worker owns
(:func:`accelsched.policy.requests.owned`) and how many it asks for
(:func:`accelsched.policy.requests.decide_claim`), reports them (``accelsched_inventory``) and
advertises only what the scheduler granted. Later it may ask for its own restart
(``accelsched_restart``). Each request names this process and carries an id it never
uses again, so the scheduler acts on it once and never on behalf of a process that took
this address since (:mod:`accelsched.policy.requests`).
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import sys
import threading
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from time import monotonic
from typing import TYPE_CHECKING, Any

from dask.utils import key_split

from accelsched import events, internals
from accelsched.config import Threshold
from accelsched.context import using_device
from accelsched.devices import (
    HOST_TYPES,
    DeviceInfo,
    MemoryReading,
    NVMLMonitor,
    PoolStats,
    active_pools,
    device_nbytes,
    knows,
)
from accelsched.policy.leak import (
    MAX_PREFIXES,
    Answer,
    Backoff,
    DeviceHealth,
    LeakDecisions,
    Remeasured,
    Verdict,
    estimate,
    judge_answers,
)
from accelsched.policy.proposals import Proposal
from accelsched.policy.requests import decide_claim, declared_count, owned
from accelsched.policy.requirements import LeaseTable, MiB, capacity, held_counted
from accelsched.protocol import (
    INVENTORY_HANDLER,
    OFFER_HANDLER,
    RESTART_HANDLER,
    Addressed,
    GuardMetric,
    InventoryReply,
    InventoryRequest,
    OfferRequest,
    ReportReply,
    RestartReply,
    RestartRequest,
    RestartStatus,
    placement_served,
)

if TYPE_CHECKING:
    from distributed import Worker

    from accelsched.internals.worker import Residence

__all__ = [
    "Inventory",
    "LEARN",
    "LeakCheck",
    "Ledger",
    "MEASURE",
    "Meter",
    "SKIP",
    "WorkerActor",
    "net_of_pools",
    "under_dask_cuda",
]

logger = logging.getLogger(__name__)

#: Request ids: this process uses each once, whatever guard sends it. The scheduler
#: remembers every id a worker sent while its process is registered, so a GuardPlugin
#: registered again in the same worker must not start counting anew (its requests would
#: be refused as replayed). (``next()`` on a count is atomic.)
_REQUEST_IDS = itertools.count()


class LeakCheck:
    """Reads this worker's owned devices, estimates their leaks and acts on what the
    decisions propose; each option is the guard's (``docs/configuration.md``)."""

    def __init__(
        self,
        *,
        inventory: Inventory,
        leases: LeaseTable,
        used: set[int],
        ledger: Ledger,
        actor: WorkerActor,
        decisions: LeakDecisions,
        threshold: Threshold,
        recover: bool = True,
    ) -> None:
        # the inventory's devices (its lists, kept up to date in place) and their health
        # records, which ``decisions`` share; the binder's leases and the devices its
        # GPU tasks held (kept up to date in place)
        self._inventory = inventory
        self._leases, self._used = leases, used
        self._ledger = ledger
        self._actor = actor
        self._decisions = decisions
        self._threshold = threshold
        self._recover = recover  # ``recover_gpus``: a withdrawn device answering comes back
        #: A task of this prefix started (hot path: the decisions' own method, no call more).
        self.ran: Callable[[str], None] = decisions.ran
        self.last_verdicts: list[Verdict] = []
        self.owed = False  # the last check skipped a busy device
        #: Checks completed since setup: tells a reader (a status page, a test waiting
        #: for "no leak") that the check has run since a moment of interest, which the
        #: verdicts alone cannot (they look the same before and after a clean check).
        self.checks: int = 0

    def check(self) -> list[Verdict]:
        """One leak check over this process's devices (periodic, on the event loop).

        Devices with a GPU task running are skipped: a task's temporaries are neither
        results nor leaks, and the estimate means nothing until it ends. Which devices are
        busy is read before and after NVML, so a task starting in between is not judged.
        """
        inv, leases, monitor = self._inventory, self._leases, self._inventory.monitor
        busy = leases.busy()
        pools = active_pools()
        # each owned device not busy, read; what the answers call for (withdraw, recover,
        # ask for a restart) is done before anything is judged
        readings: dict[int, MemoryReading] = {}
        answers: list[Answer] = []
        for dev in inv.owned:
            if dev.index in busy:
                continue
            try:
                monitor.used(dev.index)  # both queries must answer
                readings[dev.index] = monitor.process_memory(dev.index)
            except Exception as exc:  # NVMLError: the device stopped answering
                # one not granted is not ours to offer: nothing to withdraw
                answers.append(
                    Answer(dev.index, dev.uuid, error=repr(exc), granted=dev in inv.granted)
                )
            else:
                answers.append(Answer(dev.index, dev.uuid))
        self._actor.apply(judge_answers(inv.health, answers, recover=self._recover))
        busy |= leases.busy()
        # a device skipped while busy is judged as soon as a task ends (the guard calls
        # check again then): a queue of back-to-back GPU tasks holds it nearly always
        self.owed = any(dev.index in busy and dev.index in self._used for dev in inv.owned)
        limits = {dev.index: self._threshold.resolve(dev.memory) for dev in inv.owned}
        # judged, in the order read: each device not running, that a GPU task of this
        # worker held, with a figure of this process's own there
        estimates = {
            device: (self._estimate(device, reading.nbytes, pools, limits[device]), limits[device])
            for device, reading in readings.items()
            if device not in busy
            and device in self._used
            and reading.has_context is not False
            and reading.attributable
        }
        verdicts = self.last_verdicts = self._decisions.count(estimates)
        proposals = self._decisions.propose(
            verdicts,
            # Complete only with no GPU task in a thread: one that has started (its prefix
            # recorded) but not yet taken its lease leaves its device unjudged or unused,
            # and a check then would wrongly clear its prefix as clean (under load, a leak
            # was reported with no suspects).
            complete=not busy and not leases.gpu_keys(),
            executing=leases.gpu_keys,
        )
        start = monotonic()
        self._actor.apply(proposals)
        # collected and freed: the devices tried, measured again, and the outcome acted on.
        # A device a task took meanwhile is not judged: its count stays, and the check runs
        # again when the task ends. One NVML does not answer is withdrawn at the next check.
        after: dict[int, Remeasured] = {}
        for device in self._decisions.trying:  # (reclaiming never creates a pool)
            try:
                reading = monitor.process_memory(device)
            except Exception:  # NVMLError
                after[device] = Remeasured(None)
                continue
            if device in leases.busy():
                self.owed = True
                continue
            leaked = self._estimate(device, reading.nbytes, pools, limits[device])
            after[device] = Remeasured(leaked, monotonic() - start)
        self._actor.apply(self._decisions.reclaimed(after))  # none proposed: nothing
        self.checks += 1
        return verdicts

    def _estimate(self, device: int, process: int, pools: list, limit: int) -> int:
        """The leak estimate of ``device`` from this process's reading. One at or under
        its threshold (``limit``) is settled: its reading net of pools is a base for measuring what
        arrives from peers."""
        pool = sum((p.stats(device) for p in pools), PoolStats())
        live = self._ledger.live(device)
        # The baseline is lowered by what is on the device now: a result spilled out of
        # memory gave its device memory back (counted, the baseline would fall below the
        # context, and once its key went the context would read as a leak). The estimate
        # still counts it as live: a run measured while another key spilled measured
        # that much less, so counting it gone there could make a leak of nothing.
        resident = self._ledger.resident(device)
        baseline = self._decisions.devices[device].observe_baseline(process, resident, pool.held)
        leaked = estimate(process, baseline, live, pool)
        if leaked <= limit:
            self._ledger.settle(device, net_of_pools(process, pool))
        return leaked

    def heartbeat_metric(self, worker: Any = None) -> GuardMetric:
        """Leases in use and leak estimates of the granted devices, for ``accelsched
        status`` and the dashboard page (distributed calls it with the worker at each
        heartbeat; O(devices + running GPU tasks)). A device a GPU task holds is not
        judged (its temporaries are no leak): its estimate is the last one made."""
        leases, inv = self._leases, self._inventory
        held = Counter(d for devices in leases.holders().values() for d in devices)
        withdrawn, declared = inv.health.withdrawn, leases.declared()
        return {
            "devices": [
                {
                    "index": dev.index,
                    "leases": held.get(dev.index, 0),
                    "withdrawn": dev.index in withdrawn,
                    "leak_estimate": self._decisions.devices[dev.index].estimate,
                    "leak_threshold": self._threshold.resolve(dev.memory),
                    "declared": declared.get(dev.index, 0),
                }
                for dev in inv.granted
            ]
        }


class WorkerActor:
    """Carries out the worker's proposals, in the order given; with ``report`` (the
    guard's inventory report, given with ``recover_gpus``), probes the devices left out
    of the inventory when their :class:`~accelsched.policy.leak.DeviceHealth` says, and
    reports those back."""

    def __init__(
        self,
        *,
        inventory: Inventory,
        set_devices: Callable[[list[int]], None],
        emit: Callable[..., None],
        spawn: Callable[..., None],
        report: Callable[[], Awaitable[ReportReply]] | None = None,
        clock: Callable[[], float] = monotonic,
    ) -> None:
        self.inventory = inventory
        self._set_devices = set_devices  # the devices leases may land on
        self._emit = emit  # one event to the scheduler's log
        self._spawn = spawn  # runs a coroutine function in the background
        self._report, self._clock, self._reporting = report, clock, False
        if report is not None:
            for index in inventory.monitor.left_out:
                inventory.health.left_out(index, clock())
        # Move every object alive now (modules, the worker, the guard) out of the
        # collector's reach, once: a reclaim's full collection then scans only what was
        # made since (it holds the event loop). Reference counting still frees them.
        if not gc.get_freeze_count():
            gc.freeze()

    def apply(self, proposals: Iterable[Proposal]) -> None:
        """Carry out ``proposals`` in order; consecutive reclaims share one collection."""
        for action, group in itertools.groupby(proposals, key=lambda p: p.action):
            if action == "reclaim":
                reclaim([p.subject for p in group])
                continue
            # each action by the method of its name (``report-leak``: report_leak)
            act = getattr(self, action.replace("-", "_"), None)
            if act is None:
                raise ValueError(f"not a worker's action: {action!r}")
            for p in group:
                act(p)

    def withdraw(self, p: Proposal) -> None:
        """Say so and offer what is usable now (the health record says which devices
        are out): leases at once, the count right after. Withdrawn, no new lease lands
        on the device and the worker advertises one GPU fewer (tasks assigned against
        the old count that no longer fit go back); recovered, it is offered again."""
        event = events.GPU_UNHEALTHY if p.action == "withdraw" else events.GPU_RECOVERED
        self._emit(event, device=p.subject, **p.detail)  # uuid (withdrawn: and error)
        self._set_devices(self.inventory.usable)
        self._spawn(self.inventory.offer, self._set_devices)

    recover = withdraw

    def report_leak(self, p: Proposal) -> None:
        self._emit(
            events.LEAK,
            device=p.subject,
            nbytes=int(p.figures["nbytes"]),
            threshold=int(p.figures["threshold"]),
            checks=int(p.figures["checks"]),
            prefixes=list(p.detail["prefixes"]),
            attributed=dict(p.detail["attributed"]),
            unexplained=int(p.figures["unexplained"]),
            reclaimed=int(p.figures["reclaimed"]),
        )

    def report_reclaimed(self, p: Proposal) -> None:
        self._emit(
            events.LEAK_RECLAIMED,
            device=p.subject,
            nbytes=int(p.figures["nbytes"]),
            reclaimed=int(p.figures["reclaimed"]),
            remaining=int(p.figures["remaining"]),
            threshold=int(p.figures["threshold"]),
            prefixes=list(p.detail["prefixes"]),
            seconds=p.figures["seconds"],
        )

    def ask_restart(self, p: Proposal) -> None:
        self.inventory.ask_restart(p.reason or "", int(p.figures.get("nbytes", 0)))

    def rejoin(self) -> None:
        """Probe the left-out devices due now, and report those back when due (event
        loop, at each check)."""
        health, monitor, now = self.inventory.health, self.inventory.monitor, self._clock()
        report = False
        for index in health.due(now):
            if index in monitor.left_out:  # probed: listed once it is back
                try:
                    info = monitor.query(index)
                except Exception:  # NVMLError: still out
                    health.retry(index, now)
                    continue
                if not health.probe_answered(index, now):
                    continue
                self.inventory.rejoin(info)
            report = True  # back now, or back and not granted yet: report it (again)
        if report and not self._reporting:
            self._reporting = True
            self._spawn(self._report_back)

    async def _report_back(self) -> None:
        """Report the inventory with the devices back; say which the scheduler granted,
        and when to report the others again."""
        assert self._report is not None  # only rejoin() calls it, with a report
        try:
            reply = await self._report()
        finally:
            self._reporting = False
        health, monitor = self.inventory.health, self.inventory.monitor
        granted, now = {d.uuid for d in self.inventory.granted}, self._clock()
        for index in health.waiting:
            if index in monitor.left_out:
                continue
            info = monitor.device(index)
            if info.uuid in granted:
                health.granted(index)
                self._emit(events.GPU_RECOVERED, device=index, uuid=info.uuid)
            elif health.retry(index, now) == health.first:  # once per device back
                logger.info(
                    "accelsched: GPU %d answers NVML again but is not granted yet (%s); "
                    "reporting it again",
                    index,
                    reply.get("status"),
                )


#: Ledger.plan's answers.
MEASURE, LEARN, SKIP = 0, 1, 2
#: Result types that never hold device memory, as a set (asked of every result).
_PLAIN = frozenset(HOST_TYPES)


def net_of_pools(nbytes: int, pool: PoolStats) -> int:
    """A process's device bytes less what its pools cache or hold in reserve unused.

    An allocation from a fixed pool (RMM) leaves NVML's figure unchanged and shrinks the
    reserve's free part: counted so, a result allocated there is measured at its size
    (else it would be measured at 0 while the leak estimate, which counts only the free
    part of the reserve as retained, sees it as unexplained). When the pool cannot say
    how much of its reserve is free, all of it is left out.
    """
    return nbytes - pool.cached - (pool.fixed if pool.fixed_free is None else pool.fixed_free)


class Ledger:
    """Measured device bytes per key; the last fully explained reading per device."""

    def __init__(
        self,
        monitor: NVMLMonitor,
        *,
        residue: Callable[[str, dict[int, int]], None] | None = None,
        left_nothing: Callable[[str, int], None] = lambda prefix, runs: None,
        stored: Callable[[Any], Any] = lambda key: None,
        idle: Callable[[], set[int]] = set,
        in_memory: Residence | None = None,
    ) -> None:
        self.monitor = monitor
        self.residue = residue  # (step or task prefix, bytes it left behind): attribution
        self.left_nothing = left_nothing  # (task prefix, runs): runs that left nothing
        self._stored = stored  # key -> its value in the worker's memory (or None)
        self._idle = idle  # the owned devices no task holds now
        # where the values are: in memory or spilled (None: nothing spills)
        self._in_memory = in_memory
        self._lock = threading.Lock()
        # key -> {device: bytes}: measured as its task returned, until it enters memory
        # (or is released without)
        self._measured: dict[Any, dict[int, int]] = {}
        # key -> {device: bytes}: what it holds while in memory (results from elsewhere too)
        self._held: dict[Any, dict[int, int]] = {}
        self._live: dict[int, int] = {}  # device -> bytes results in memory hold
        # results known by type that share an allocation (an identity step's result is
        # its input; a view keeps its base): per allocation (a token), the keys holding
        # it and what is live of it (the most any of them held, per device); the token
        # of each such key; the token by the allocation's id, while one of them holds it
        self._shared: dict[int, tuple[set[Any], dict[int, int], int]] = {}
        self._allocation_of: dict[Any, int] = {}
        self._by_id: dict[int, int] = {}
        self._tokens = itertools.count()
        # device -> noncache bytes: the base data from peers is measured from, a reading
        # when all was explained (or, in ``_fetched``, one taken as a fetch started)
        self._settled: dict[int, int] = {}
        self._fetched: set[int] = set()  # devices whose base was read as a fetch started
        # device -> ``_context_gen`` when a reading as a fetch started gave no figure
        self._unreadable: dict[int, int] = {}
        # device -> [the reading that ended the last measured task there, and the
        # unmeasured runs since: their prefix (None: none), how many, what their results
        # hold there by type]: the next task's base, unless memory changed meanwhile (a
        # key released, data arrived); one prefix's stretch at most
        self._fresh: dict[int, list[Any]] = {}
        # changes noted on the event loop (a key released, data arrived): a closing
        # reading taken across one of them is not reused as a base
        self._changes = 0
        # the same, for a measured run's growth (:meth:`moves`): data of a type nobody
        # described that arrived (on some device), and per device the unmeasured changes
        # there (a key released, data arrived that holds memory there)
        self._arrived = 0
        self._moved: dict[int, int] = {}
        # devices where the last reading found no context of this process, and nothing
        # since can have made one (see plan): no reading can be a base there meanwhile
        self._no_context: set[int] = set()
        self._context_gen = 0  # bumped whenever that knowledge is dropped
        self._clean: set[str] = set()  # prefixes whose runs were seen to make no context
        # which runs of a prefix are measured on devices with a context, per prefix and
        # devices (a stretch of unmeasured runs is a device's)
        self.sampler = Backoff()

    def read(self, device: int, record: bool = False) -> tuple[int | None, bool]:
        """This process's bytes on ``device`` minus what pools cache or reserve (None
        when NVML cannot tell: no figure of its own, no context yet, or an error), and
        whether this reading itself found no context there (what the knowledge
        :meth:`plan` relies on may have been dropped meanwhile).

        ``record``: a reading taken between GPU tasks (no task code runs on ``device``
        until the next one), whose "no context" :meth:`plan` may rely on; a reading inside
        a task (a marked step's) may be followed by that task making a context."""
        gen = self._context_gen
        try:
            reading = self.monitor.process_memory(device)
        except Exception:
            return None, False
        if reading.has_context is False:
            if record:
                with self._lock:
                    if gen == self._context_gen:  # nobody dropped the knowledge meanwhile
                        self._no_context.add(device)
            return None, True  # a context made now would be counted as the task's
        if device in self._no_context:
            self.recheck((device,))  # there is one now (or NVML cannot tell)
        if not reading.attributable or not reading.has_context:
            return None, False
        pool = sum((p.stats(device) for p in active_pools()), PoolStats())
        return net_of_pools(reading.nbytes, pool), False

    # --- around a GPU task (its executor thread) ----------------------------------------

    def plan(self, devices: tuple[int, ...], prefix: str, *, found_none: bool = False) -> int:
        """How to measure a task of ``prefix`` on ``devices``: :data:`MEASURE` (a base
        reading, or the last task's closing one, and a closing reading), :data:`LEARN`
        (no base can exist: the last reading found no context on its devices; one closing
        reading tells whether this prefix makes one) or :data:`SKIP` (no context, and
        the prefix was seen not to make one: no reading at all).

        Without a context on a device no reading can be a base (the context a task makes
        would count as its growth), so a run there is never measured; reading NVML only
        to learn that costs tens of microseconds per tiny task. The knowledge is dropped
        by :meth:`recheck` (every leak check), by a run of an unknown prefix that made a
        context and by a pool holding memory there after a run (:meth:`unmeasured`).
        ``found_none``: a reading just taken found no context on any of ``devices``,
        whatever a leak check dropped meanwhile.
        """
        if not found_none and not self._no_context.issuperset(devices):
            return MEASURE
        return SKIP if prefix in self._clean else LEARN

    def unmeasured(self, devices: tuple[int, ...], prefix: str, plan: int) -> bool:
        """After a task run under :data:`LEARN` or :data:`SKIP` (before pools are freed):
        is there still no context on its devices? Returns whether the run is known to
        have left nothing there (no context before it, none after it as far as the
        ledger knows, no pool holding memory)."""
        if plan == LEARN:
            gen = self._context_gen
            # records "no context" again, or finds one
            if all([self.read(d, True)[1] for d in devices]):
                with self._lock:
                    if gen == self._context_gen and self._no_context.issuperset(devices):
                        if len(self._clean) >= MAX_PREFIXES:
                            self._clean.clear()
                        self._clean.add(prefix)
                return True  # these readings saw none, whatever a recheck dropped meanwhile
        if pools := active_pools():
            try:
                held = any(p.stats(d).held for p in pools for d in devices)
            except Exception:  # a pool that cannot say: read NVML before the next task
                held = True
            if held:
                self.recheck(devices)  # a pool holds memory: a context exists there
                return False
        return plan == SKIP

    def recheck(self, devices: tuple[int, ...] | None = None) -> None:
        """Read NVML again before the next task on ``devices`` (all when None): a context
        may exist there now."""
        with self._lock:
            self._context_gen += 1
            if devices is None:
                self._no_context.clear()
            else:
                self._no_context.difference_update(devices)

    def take_base(
        self,
        devices: tuple[int, ...],
        prefix: str | None,
        *,
        record: bool = False,
        reuse_only: bool = False,
    ) -> tuple[dict[int, int] | None, bool, int]:
        """The base to measure a task by: the last task's closing reading where nothing
        changed since (back-to-back GPU tasks cost one NVML read per device, not two);
        whether every device was read now and found no context (``record``: see
        :meth:`read`); and the unmeasured runs of ``prefix`` the base reaches back over
        (the stretch, measured with this run). The last closing reading serves as
        the base only where the unmeasured runs since were ``prefix``'s: another
        prefix's stay unmeasured (their results known by type, what they left found by
        the periodic check alone). A base reaching back is raised by what the stretch's
        results hold by type, so that they are not counted as grown. ``reuse_only``: no
        reading now (a task already ran): None where there is no reading to reuse."""
        with self._lock:
            last = [self._fresh.pop(d, None) for d in devices]
        fresh = [None if f is None or f[1] not in (None, prefix) else f[0] + f[3] for f in last]
        runs = max((f[2] for f in last if f is not None and f[1] == prefix), default=0)
        if reuse_only and None in fresh:
            return None, False, 0
        read = [
            self.read(d, record) if then is None else (then, False)
            for d, then in zip(devices, fresh, strict=True)
        ]
        base = {d: v for d, (v, _) in zip(devices, read, strict=True) if v is not None}
        return (base if len(base) == len(devices) else None), all(e for _, e in read), runs

    def stretched(self, devices: tuple[int, ...], prefix: str, known: dict[int, int]) -> None:
        """An unmeasured run of ``prefix`` ended on ``devices``, its result holding
        ``known`` by type: it joins the stretch since the last closing reading there,
        unless the stretch is another prefix's (then the stretch ends unmeasured).

        No run needs to prove it ran alone: every run ends by joining or ending its
        devices' stretch, and a closing reading is taken only by a run alone on its
        devices, so what a stretch reaches back over is its prefix's runs alone."""
        with self._lock:
            fresh = self._fresh
            for d in devices:
                f = fresh.get(d)
                if f is None or f[1] not in (None, prefix):
                    break
            else:
                for d in devices:
                    f = fresh[d]
                    f[1:] = [prefix, f[2] + 1, f[3] + known.get(d, 0)]
                return
        self.forget(devices)  # memory changed unmeasured: no base from before it

    def moves(self, devices: Iterable[int]) -> tuple[int, ...]:
        """A token of the changes on ``devices`` no task's reading explains: data arrived
        from a peer holding memory there (one of a type nobody described: anywhere), a key
        released there. Taken before a base and given to :meth:`after`: memory that moved
        between the two readings is no growth of the run's (a result released as it ran
        would hide what it left; a fetch landing as it ran would count as its own). The
        hook hears of an arrival once its bytes have landed: a run whose closing reading
        falls in between still counts them."""
        moved = self._moved
        return (self._arrived, *[moved.get(d, 0) for d in devices])

    def after(
        self, key: Any, before: dict[int, int], result: Any, moves: tuple[int, ...]
    ) -> tuple[dict[int, int], int] | None:
        """Hold the task's growth against ``key`` (None: a marked step's, held by no key);
        return its residue (bytes left behind beyond its known result: 0 when the result's
        type is unknown, its growth may be the result itself) and its growth in all. None,
        and nothing held, when memory moved otherwise since ``before`` was read (``moves``:
        :meth:`moves` then), or a closing reading gave no figure (NVML failed on the
        device for a moment): no growth is the run's to tell. (Taken as no growth, its
        result would be held at nothing and read as a leak: a healthy worker restarted.)"""
        known = device_nbytes(result) if knows(result) else None
        if key is None and known is None:
            return {}, 0  # a step's unknown result: nothing to learn, nothing to hold
        changes = self._changes  # a key released or data arrived meanwhile: no base from it
        held, residue, now = {}, {}, {}
        for device, then in before.items():
            if (n := self.read(device)[0]) is None:
                return None
            grew = max(0, n - then)
            # a known result holds its own size, and what else the run left is residue;
            # an unknown one holds all the growth (nothing tells it from a leak)
            held[device] = size = known.get(device, 0) if known is not None else grew
            residue[device] = max(0, grew - size)
            now[device] = n
        with self._lock:
            if self.moves(before) != moves:
                return None
            if key is not None:
                self._measured[key] = held
                if self._changes == changes:
                    for d, n in now.items():
                        self._settled[d] = n
                        self._fetched.discard(d)
                        self._fresh[d] = [n, None, 0, 0]
        return residue, sum(held.values()) + sum(residue.values())

    # --- on the event loop ----------------------------------------------------------------

    def entered(self, key: Any, *, computed: bool) -> dict[int, int]:
        """``key`` entered the worker's memory: ``computed`` here (measured by its task,
        else known by type), or data from elsewhere (a peer's transfer, a replica, a
        scatter: known by type, else measured on the idle devices since the last
        explained reading). Held until :meth:`released`; returns what it holds."""
        if computed:  # (its thread has returned: nothing else takes its measurement)
            measured = self._measured.pop(key, None)
        else:
            with self._lock:  # memory may have grown: no reused base
                measured = self._measured.pop(key, None)
                self._fresh.clear()
                self._changes += 1
        if measured is not None and computed:  # the measurement wins: known without its value
            held = {d: n for d, n in measured.items() if n}
            if held and knows(value := self._stored(key)):  # another key may hold it too
                return self._hold_allocation(key, held, value)
        elif self.holds_nothing(value := self._stored(key)):
            held = {}
        elif computed or knows(value):
            held = device_nbytes(value)
            if held:  # by type: another key may hold the same allocation
                if not computed:
                    self._arrival(held, known=True)
                return self._hold_allocation(key, held, value)
        else:  # from a peer, of a type nobody described: the growth on the idle devices
            held, typed = {}, device_nbytes(value)
            for device in self._idle():
                with self._lock:
                    then = self._settled.get(device)
                    if typed and device in self._fetched:
                        then = None  # what its type says rather than an unexplained base
                # without an explained base to measure from: type knowledge only
                if then is not None and (now := self.read(device)[0]) is not None:
                    with self._lock:
                        self._settled[device] = now
                        self._fetched.discard(device)
                    if now > then:
                        held[device] = now - then
            held = held or typed
        if not computed:  # memory moved under a measured run: where, as far as it is known
            self._arrival(held, known=self.holds_nothing(value) or knows(value))
        if held:
            self._held[key] = held
            for d, n in held.items():
                self._live[d] = self._live.get(d, 0) + n
        return held

    def _arrival(self, held: dict[int, int], *, known: bool) -> None:
        """Data from elsewhere entered, holding ``held``: a measured run on those devices
        is not to count it (:meth:`moves`); one of a type nobody described may have landed
        on any device. A plain value moved nothing."""
        with self._lock:
            if not known:
                self._arrived += 1
            moved = self._moved
            for d, n in held.items():
                if n:
                    moved[d] = moved.get(d, 0) + 1

    def fetching(self) -> None:
        """Data is about to come from a peer (a key's fetch started, on the event loop):
        where a change nobody measured (a key released, a task beside another) left no
        base to measure it from, a reading now is one, taken before its bytes land.

        It counts whatever is there, a leak included: memory left behind before the fetch
        is not taken for the arrival's. Without it, data of a type nobody described
        arriving right after a release would be held at what its type says, nothing, and
        its bytes read as a leak. Where a base is kept, nothing is read, nor where a
        reading gave no figure (no context, none of this process's own) since the last
        leak check: at most one reading per device for the keys of a fetch.

        Such a base counts what was there unexplained: it is used only for data whose
        type says nothing of its size (:meth:`entered`), not in place of dask's
        ``sizeof`` of a GPU library's type (several keys of a fetch land together, and
        the first to enter would take them all)."""
        idle = self._idle()
        for device in idle:
            if device in self._settled or self._unreadable.get(device) == self._context_gen:
                continue
            changes, gen = self._changes, self._context_gen
            now = self.read(device)[0]
            if now is None:
                self._unreadable[device] = gen
            elif device in self._idle():  # no task took it meanwhile (its temporaries)
                with self._lock:
                    if self._changes == changes and device not in self._settled:
                        self._settled[device] = now
                        self._fetched.add(device)

    def released(self, key: Any) -> bool:
        """``key`` left the worker's memory, or will not enter it (cancelled, forgotten):
        its memory went back unmeasured. Whether it held any (room freed)."""
        if key in self._measured:  # (most keys are not: no lock taken for them)
            with self._lock:
                self._measured.pop(key, None)
        held = self._held.pop(key, None)
        if not held:
            return False
        if (token := self._allocation_of.pop(key, None)) is not None:
            keys, counted, allocation = self._shared[token]
            keys.discard(key)
            if keys:  # another key holds it still: nothing went back
                return False
            del self._shared[token]
            if self._by_id.get(allocation) == token:
                del self._by_id[allocation]
            held = counted  # (what was live)
        for d, n in held.items():
            self._live[d] -= n
        self.forget(held)
        return True

    def _hold_allocation(self, key: Any, held: dict[int, int], value: Any) -> dict[int, int]:
        """``key`` holds ``held`` of its value's allocation: live once per allocation,
        however many keys hold it (counted twice, its bytes would later lower the
        baseline below the context, and once released the context would read as a leak).
        An id is only the allocation's while a key holding it still has it in memory: a
        freed object's id taken by a new one starts a new allocation."""
        if key in self._allocation_of:  # (entered again: what it held first goes)
            self.released(key)
        root = _allocation(value)
        token = self._by_id.get(allocation := id(root))
        if token is not None:
            holder = next(iter(self._shared[token][0]))
            mine = self._stored(holder)
            if mine is None or _allocation(mine) is not root:
                token = None  # that allocation went (spilled, say) and its id was reused
        self._held[key] = held
        if token is None:
            token = self._by_id[allocation] = next(self._tokens)
            self._shared[token] = (set(), {}, allocation)
        keys, counted, _ = self._shared[token]
        keys.add(key)
        self._allocation_of[key] = token
        for d, n in held.items():  # live: the most any key sharing it held there
            if n > (was := counted.get(d, 0)):
                counted[d] = n
                self._live[d] = self._live.get(d, 0) + n - was
        return held

    def live(self, device: int) -> int:
        """Bytes results in the worker's memory hold on ``device``."""
        return self._live.get(device, 0)

    def resident(self, device: int) -> int:
        """:meth:`live` less what results spilled out of memory held on ``device``: their
        device memory went back as they left (read back, they hold it again). An
        allocation several keys share is gone once none of them is in memory.
        O(results holding device memory), once per leak check."""
        live = self._live.get(device, 0)
        if (where := self._in_memory) is None or not live or not where.any_out():
            return live
        here = where.holds
        gone, seen = 0, set()
        for key, held in list(self._held.items()):
            if not held.get(device) or here(key):
                continue
            if (token := self._allocation_of.get(key)) is None:
                gone += held[device]
            elif token not in seen:
                seen.add(token)
                keys, counted, _ = self._shared[token]
                if not any(here(k) for k in keys):
                    gone += counted.get(device, 0)
        return live - gone

    @staticmethod
    def holds_nothing(value: Any) -> bool:
        """Whether ``value``, unmeasured, holds nothing on a device by its type alone (a
        number, a string: nothing to ask)."""
        return value is None or type(value) in _PLAIN

    def settle(self, device: int, noncache: int) -> None:
        """Everything on ``device`` is explained now (a check found no leak there)."""
        with self._lock:
            self._settled[device] = noncache
            self._fetched.discard(device)

    def forget(self, devices: Iterable[int]) -> None:
        """Memory on ``devices`` changed unmeasured (a key released): no base to compare."""
        with self._lock:
            moved = self._moved
            for device in devices:
                self._settled.pop(device, None)
                self._fetched.discard(device)
                self._fresh.pop(device, None)
                moved[device] = moved.get(device, 0) + 1
            self._changes += 1


def _allocation(value: Any) -> Any:
    """The object that owns ``value``'s memory: its ``base``, for an array that is a view
    of another (CuPy's, as NumPy's), else ``value``. A ``base`` that holds no device
    memory by its type (a handle, a pool, a host object) is no allocation: not followed."""
    for _ in range(8):  # (a chain of views is short)
        try:
            base = getattr(value, "base", None)
            if base is None or not knows(base) or not device_nbytes(base):
                return value
        except Exception:  # an odd property: the value itself
            return value
        value = base
    return value


class Meter:
    """One GPU task's measurement, from its lease to its return; also its lease's
    ``meter`` (:attr:`accelsched.context.Lease.meter`), measuring each outermost marked
    step the task calls, so the attribution names the step that left memory behind, even
    inside a fused task.

    A reading counts only while the task holds its devices alone: the lease table's token,
    taken with the base, proves at the end that no other task took or gave back one
    meanwhile. A run left unmeasured takes no token: it ends by joining its prefix's
    stretch or ending it (:meth:`Ledger.stretched`), which is all a later reading needs
    to know of it. What :meth:`Ledger.plan` says decides whether any reading is taken, and on
    a device with a context the ledger's sampler whether this run is measured (``sample``:
    whether it may be left unmeasured; a task that declared its memory is always measured,
    its growth checked against the declaration).
    """

    __slots__ = (
        "ledger",
        "leases",
        "key",
        "devices",
        "prefix",
        "plan",
        "depth",
        "steps",
        "grew",
        "sample",
    )

    def __init__(
        self,
        ledger: Ledger,
        leases: LeaseTable,
        key: Any,
        devices: tuple[int, ...],
        prefix: str,
        sample: bool = True,
    ) -> None:
        self.ledger = ledger
        self.leases = leases
        self.key = key
        self.devices = devices
        self.prefix = prefix
        self.plan = ledger.plan(devices, prefix)
        self.depth = 0  # marked steps running now, nested
        self.steps = 0  # marked steps measured so far
        self.grew: int | None = None  # what the task added in all, when measured
        self.sample = sample

    def run(self, spec: Any, values: Any) -> Any:
        """Run the task's code, measured as planned: with no context on its devices no
        reading can be a base (the context a task makes would count as its growth), so it
        is not read around, only checked after (:meth:`Ledger.unmeasured`).

        A run the sampler leaves unmeasured takes no reading when its result's footprint
        is known by type (it joins its prefix's stretch); one closing reading, from the
        last reading before the stretch, when it is not (held at its growth, as ever)."""
        ledger, token, base, runs = self.ledger, None, None, 0
        moves: tuple[int, ...] = ()  # the ledger's, taken before the base (:meth:`_close`)
        if self.plan == MEASURE:
            if self.sample and not ledger.sampler.measure((self.prefix, self.devices)):
                try:
                    result = spec(values)
                except BaseException:  # it ran too: it joins its stretch, or ends another's
                    ledger.stretched(self.devices, self.prefix, {})
                    raise
                if not self.steps:
                    known = (  # holds_nothing first: the common case, per unmeasured run
                        {}
                        if ledger.holds_nothing(result)
                        else device_nbytes(result)
                        if knows(result)
                        else None
                    )
                    if known is not None:  # footprint known by type: the stretch grows
                        ledger.stretched(self.devices, self.prefix, known)
                        return result
                    # of a type nobody described: measured from before the stretch, when
                    # no other task holds its devices now (one that ran meanwhile ended
                    # the stretch, or joined it)
                    if (token := self.leases.alone_token(self.key)) is not None:
                        moves = ledger.moves(self.devices)
                        base, _, runs = ledger.take_base(self.devices, self.prefix, reuse_only=True)
                        if base is not None:
                            return self._close(base, result, runs, token, moves, stretch=True)
                    # the stretch broke meanwhile: held by type, measured from now on
                return self._unmeasured(result)  # memory changed unmeasured
            # alone, the base reading (not alone: none), whether it found no context
            # anywhere, and the unmeasured runs of this prefix it reaches back over
            token = self.leases.alone_token(self.key)
            moves = ledger.moves(self.devices)
            base, empty, runs = (
                (None, False, 0)
                if token is None
                else ledger.take_base(self.devices, self.prefix, record=True)
            )
            if base is None:
                # a base reading that found no context plans the run itself, whatever a
                # leak check dropped meanwhile (else it would be neither measured nor seen
                # to leave nothing); not alone, another task's reading may have found none
                self.plan = ledger.plan(self.devices, self.prefix, found_none=empty)
        if self.plan != MEASURE:
            try:
                return spec(values)
            finally:
                if ledger.unmeasured(self.devices, self.prefix, self.plan):
                    ledger.left_nothing(self.prefix, 1)
        try:
            result = spec(values)
        except BaseException:  # what it left is no stretch's: a run beside it ends its own
            ledger.forget(self.devices)
            raise
        if base is not None and self.leases.still_alone(self.key, token):
            return self._close(base, result, runs, token, moves)
        # not alone: the sampler keeps this run due, so the next one is measured
        return self._unmeasured(result, stretch=False)

    def _unmeasured(self, result: Any, *, stretch: bool = True) -> Any:
        """``result``, whose run could not be measured after all: no base from before it
        is left for arrivals on its devices. A result nothing describes (held only at a
        measured growth) from a run of its prefix's stretch (``stretch``: one the sampler
        left unmeasured) has every run of the prefix measured again; a run the sampler
        wanted measured stays due without it."""
        ledger = self.ledger
        ledger.forget(self.devices)
        if stretch and not ledger.holds_nothing(result) and not knows(result):
            ledger.sampler.reset((self.prefix, self.devices))
        return result

    def _close(
        self,
        base: dict[int, int],
        result: Any,
        runs: int,
        token: Any,
        moves: tuple[int, ...],
        *,
        stretch: bool = False,
    ) -> Any:
        """The closing reading of a run measured from ``base``, taken before ``runs``
        unmeasured runs of its prefix: what they and it left, attributed to the prefix.
        ``token``: the lease table's, proving it alone until the reading; ``moves``: the
        ledger's, taken before the base (memory that moved otherwise meanwhile leaves the
        run unmeasured, as one not alone); ``stretch``: a run the sampler left unmeasured,
        measured now for its result's sake."""
        ledger = self.ledger
        if (measured := ledger.after(self.key, base, result, moves)) is None:
            return self._unmeasured(result, stretch=stretch)  # memory moved: no verdict
        left, self.grew = measured
        if not self.leases.still_alone(self.key, token):
            # a task took a lease beside it as it read: what that one held then is in
            # the reading, which no later run may take as its base
            ledger.forget(self.devices)
        if ledger.residue is not None and not self.steps:
            ledger.residue(key_split(self.key), left)
        if self.grew == 0:  # the stretch's runs too: it grew by nothing
            ledger.left_nothing(self.prefix, runs + 1)
        ledger.sampler.measured((self.prefix, self.devices), any(n > 0 for n in left.values()))
        return result

    def __call__(self, name: str, call: Callable[[], Any]) -> Any:
        """Run one marked step of the task, measured when outermost (and attributed)."""
        residue = self.ledger.residue
        token = self.leases.alone_token(self.key) if self.depth == 0 and residue else None
        moves = () if token is None else self.ledger.moves(self.devices)
        base = None if token is None else self.ledger.take_base(self.devices, None)[0]
        self.depth += 1
        try:
            result = call()
        finally:
            self.depth -= 1
        if (
            base is not None
            and residue is not None
            and self.leases.still_alone(self.key, token)
            and (measured := self.ledger.after(None, base, result, moves)) is not None
        ):
            self.steps += 1
            residue(name, measured[0])
        return result


def reclaim(devices: Iterable[Any]) -> None:
    """Collect garbage, then free every active pool on each of ``devices`` (what that gave
    back is measured after, not taken from the pools' word). Never creates a pool or a
    CUDA context: pools act only where their library is already in use
    (:func:`~accelsched.devices.active_pools`).
    """
    gc.collect()
    pools = active_pools()
    for device in devices if pools else ():
        try:
            with using_device(device):
                for pool in pools:
                    pool.free_all()
        except Exception:  # a pool or device that does not answer: measure anyway
            logger.warning("accelsched: freeing pools on device %s failed", device, exc_info=True)


#: Replies to a restart request saying the scheduler is restarting this worker.
TAKEN: frozenset[RestartStatus] = frozenset({"accepted", "in-flight"})
#: Seconds not to ask again after such a reply: a restart is over in well under this
#: (about 0.2 s with fast restarts; a drain waiting for a long task answers "in-flight"
#: again), and one that was given up is asked for again after it.
RESTART_TAKEN_HOLD = 5.0


class Inventory:
    """Devices visible, owned and granted; what this worker says to the scheduler."""

    def __init__(self, worker: Worker, *, advertise_undeclared: bool, interval: float) -> None:
        """Read the devices through NVML and decide what to claim (no scheduler yet)."""
        self.advertise_undeclared = advertise_undeclared
        self.worker = worker
        self.declared: object = internals.declared_gpus(worker)  # maybe no number at all
        self.monitor = NVMLMonitor()
        self.visible: list[DeviceInfo] = []
        self.owned: list[DeviceInfo] = []
        self._take(self.monitor.devices())  # and what this worker asks for (its claim)
        self.granted: list[DeviceInfo] = []  # what the scheduler granted (placement uses)
        #: Which devices fail NVML (withdrawn: not offered) or were left out, shared with
        #: the parts that judge their answers. Left-out devices are probed at the check's
        #: pace while they answer, at most every 30 s while they do not.
        self.health = DeviceHealth(first=interval, longest=max(interval, 30.0))
        self.restart_pending = False
        #: The reason of the last request the scheduler took -> until when (monotonic)
        #: not to ask again for it: it is replacing this process (asking again would only
        #: be answered "in-flight"). Another reason (a GPU failing, asked for once) is sent.
        self.restart_taken: dict[str, float] = {}
        self.draining = False  # the scheduler restarts this worker: GPU tasks go back
        self._offering = asyncio.Lock()
        # one report at a time: a report still waiting on an answer the scheduler gave
        # before it changed (a plugin unregistered, registered again) must not undo the
        # one that heard the change
        self._report_lock = asyncio.Lock()
        #: bytes the results in this worker's memory hold on a device (the ledger's)
        self.held: Callable[[int], int] = lambda device: 0
        #: device -> bytes its declared tasks may take there, as the scheduler divided a
        #: shared device (learnt from the offer reply, for each device offered)
        self.shares: dict[int, int] = {}
        self.told = False  # an offer reply said the shares (else: no PlacementPlugin yet)
        #: whether the scheduler answered the last request as a PlacementPlugin does (None:
        #: nothing asked yet). A scheduler without one answers None and logs each request
        #: with a traceback: it is sent no offer and no restart request until a report
        #: (the scheduler asks for one when a PlacementPlugin starts) is answered.
        self.placement: bool | None = None
        self.held_said: dict[int, int] = {}  # device -> held bytes last offered, in steps
        #: device -> bytes declared tasks lease there, results about to enter memory
        #: included (the lease table's)
        self.leased: Callable[[], dict[int, int]] = dict
        self.packs_said: dict[int, int] = {}  # device -> what the last offer said it takes
        #: the last offer said more than its share somewhere: tasks packed under a larger
        #: one ran on (each task's end looks whether it takes less now: :meth:`let_go`)
        self.over = False

    def _take(self, visible: list[DeviceInfo]) -> None:
        """List ``visible``, own and claim as the policy says (in place: the guard's
        parts hold these lists)."""
        self.visible[:] = visible
        self.owned[:] = owned(self.visible, under_dask_cuda=under_dask_cuda(self.worker))
        self.claim = decide_claim(
            self.declared, len(self.owned), advertise_undeclared=self.advertise_undeclared
        )

    def rejoin(self, device: DeviceInfo) -> None:
        """A device left out at setup answers steadily again: list it, and own and claim
        it as if it had answered then (the next :meth:`report` says so)."""
        self.monitor.adopt(device)
        self._take(list(self.monitor.devices()))

    async def report(self, on_granted: Callable[[list[int]], None]) -> ReportReply:
        """Report the owned devices and advertise what the scheduler granted.

        ``on_granted`` receives the CUDA indices granted, before the worker advertises
        them, so no GPU task can start before its devices are known.
        """
        async with self._report_lock:
            return await self._report_once(on_granted)

    async def _report_once(self, on_granted: Callable[[list[int]], None]) -> ReportReply:
        request: InventoryRequest = {
            **self._addressed(),
            "devices": [d.as_dict() for d in self.owned],
            "declared": declared_count(self.declared),
            "requested": self.claim.count,
            "reason": self.claim.reason,
        }
        reply: InventoryReply | None = None
        try:
            if await placement_served(self.worker.scheduler) is not False:
                reply = await getattr(self.worker.scheduler, INVENTORY_HANDLER)(**request)
            self.placement = reply is not None  # None: no such handler there
        except Exception as exc:
            if internals.worker_closing(self.worker):  # it closed meanwhile: nothing to say
                return {"status": "closing"}
            logger.info("accelsched: GPU report to the scheduler failed: %r", exc)
        if isinstance(reply, dict) and reply.get("status") == "OK":
            granted = set(reply.get("uuids", ()))
            if reply.get("draining") is True:  # quarantined (its guard registered again)
                self.draining = True
        elif reply is None:
            # No PlacementPlugin: nothing enforces placement, but the worker still
            # advertises only what it owns.
            logger.warning(
                "accelsched: no PlacementPlugin on the scheduler (its metadata names none, "
                "or it has no handler %r); correcting this worker's GPU count without "
                "verification. Placement is not enforced: start the scheduler with "
                "--preload accelsched or call accelsched.register(client)",
                INVENTORY_HANDLER,
            )
            granted = {d.uuid for d in self.owned[: self.claim.count]}
        else:
            return {"status": str(reply.get("status") if isinstance(reply, dict) else reply)}
        self.granted = [d for d in self.owned if d.uuid in granted]
        return {"status": "OK", "devices": await self.offer(on_granted)}

    @property
    def usable(self) -> list[int]:
        """The granted devices not withdrawn (as the health record says)."""
        withdrawn = self.health.withdrawn
        return [d.index for d in self.granted if d.index not in withdrawn]

    async def offer(self, on_usable: Callable[[list[int]], None]) -> list[int]:
        """Advertise the granted devices that are not withdrawn; returns their indices.

        ``on_usable`` receives them first, so no GPU task starts before its devices are
        known, and none is leased a withdrawn device. One the worker's closing cut short
        ends quietly.
        """
        async with self._offering:  # one at a time: the latest state is the last said
            usable = self.usable
            on_usable(usable)
            offered = [d for d in self.granted if d.index in usable]
            self.held_said = self.held_in_steps()
            packs = self.packs_now()
            request: OfferRequest = {
                **self._addressed(),
                "count": len(usable),
                "uuids": [d.uuid for d in offered],
                "held": {d.uuid: self.held_said.get(d.index, 0) for d in offered},
                "packs": {d.uuid: packs[d.index] for d in offered},
            }
            reply: Any = None
            try:
                if self.placement is not False:
                    reply = await getattr(self.worker.scheduler, OFFER_HANDLER)(**request)
                    self.placement = reply is not None  # None: no such handler there
            except Exception as exc:  # no PlacementPlugin: the worker's own count only
                logger.debug("accelsched: GPU offer to the scheduler failed: %r", exc)
            ok = isinstance(reply, dict) and reply.get("status") == "OK" and "memory" in reply
            if ok:  # a device the reply does not name is not placed: no room there
                said = reply.get("shares", {})
                shares = {d.index: said.get(d.uuid, 0) for d in offered}
                memory = reply["memory"]
                self.told = True
            else:  # the shares last told, else (no PlacementPlugin) its devices' capacity
                shares = {
                    d.index: self.shares.get(d.index, 0) if self.told else capacity(d.memory)
                    for d in offered
                }
                memory = sum(  # whole MiB, rounded down, as the scheduler's figure
                    max(0, shares[d.index] - self.held_said.get(d.index, 0)) // MiB for d in offered
                )
            if shares != self.shares:  # packed within them from now on
                self.shares = shares
                on_usable(usable)
            if self.granted or internals.advertises_gpus(self.worker):  # usable: granted ones
                try:
                    await internals.set_own_gpus(self.worker, len(usable), memory)
                except Exception:
                    # its connections went as it closed (results released as it restarts
                    # ask for offers): there is nobody to tell
                    if internals.worker_closing(self.worker):
                        return usable
                    raise
            self.packs_said = {d.index: packs[d.index] for d in offered}
            self.over = any(n > shares.get(d, 0) for d, n in self.packs_said.items())
            self.let_go(on_usable)  # a smaller share told: room a sharer waits for
            return usable

    def shares_of(self, usable: list[int]) -> dict[int, int]:
        """What declared tasks may take on each of ``usable``, as its lease table packs:
        the share last told, none for a device not told of yet (one back from
        withdrawal waits for the reply to the offer that names it). Before any reply
        (no PlacementPlugin yet): none said, each device's capacity."""
        return {d: self.shares.get(d, 0) for d in usable} if self.told else self.shares

    def packs_now(self) -> dict[int, int]:
        """What this worker's tasks and results may take on each granted device as it
        stands: the share it packs within, or more while tasks packed under a larger one
        (or results) hold more. Its offers say so: a device's room passes to a sharer
        only once this worker has let go of it. (Before the scheduler's first reply it
        advertises no device memory: it says none.) Results count as measured, as
        packing counts them, so a worker within its share says its share; past it, in
        the steps it offers, which hold what results add until the next offer."""
        leased, held = self.leased(), self.held
        packs = {}
        for d in self.granted:
            share, used = self.shares.get(d.index, 0), held(d.index) + leased.get(d.index, 0)
            if used > share:
                used = max(used, self.held_said.get(d.index, 0) + leased.get(d.index, 0))
            packs[d.index] = max(share, used)
        return packs

    def let_go(self, on_usable: Callable[[list[int]], None]) -> None:
        """Offer again if this worker takes less of a device than its last offer said: a
        smaller share applied, or tasks packed under a larger one ended."""
        now = self.packs_now()
        if any(now.get(d, 0) < n for d, n in self.packs_said.items()):
            self.over = False  # the offer says how it stands then
            internals.spawn(self.worker, self.offer, on_usable)

    def held_in_steps(self) -> dict[int, int]:
        """What results hold on each granted device, as offered: in steps of a
        sixteenth of it (:func:`~accelsched.policy.requirements.held_counted`)."""
        return {d.index: held_counted(self.held(d.index), d.memory) for d in self.granted}

    def ask_restart(self, reason: str, nbytes: int) -> None:
        """Ask the scheduler, once at a time, to restart this worker without loss."""
        if self.restart_pending or monotonic() < self.restart_taken.get(reason, 0.0):
            return
        try:
            internals.spawn(self.worker, self._request_restart, reason, nbytes)
        except Exception as exc:  # the worker is closing: nothing to restart
            logger.info("accelsched: restart request not sent: %r", exc)
        else:
            self.restart_pending = True

    async def _request_restart(self, reason: str, nbytes: int) -> None:
        request: RestartRequest = {**self._addressed(), "reason": reason, "nbytes": nbytes}
        try:
            if self.placement is False:  # nobody there restarts a worker: the leak is said
                return
            await internals.events_sent(self.worker)  # the leak reaches the scheduler first
            reply: RestartReply = await getattr(self.worker.scheduler, RESTART_HANDLER)(**request)
            logger.info("accelsched: restart request answered %r", reply)
            self.placement = reply is not None  # None: no such handler there
            if isinstance(reply, dict) and reply.get("status") in TAKEN:
                # a restart that is given up (no peer to take the data, say) is asked
                # for again after this: the leak is still there
                self.restart_taken = {reason: monotonic() + RESTART_TAKEN_HOLD}
        except Exception as exc:
            # a worker being replaced loses this call with its process: nothing to say
            log = logger.warning if internals.worker_in_service(self.worker) else logger.debug
            log("accelsched: restart request (%s) failed: %r", RESTART_HANDLER, exc)
        finally:
            self.restart_pending = False

    def _addressed(self) -> Addressed:
        """Whom a request speaks for: this worker's address, this process, a new id."""
        return {
            "worker": str(self.worker.contact_address),
            "process": str(self.worker.id),
            "request": str(next(_REQUEST_IDS)),
        }

    def drain(self, on: Any = True, process: Any = "") -> dict[str, str]:
        """``accelsched_drain``: while this worker restarts, send GPU tasks back as they
        reach execution (its queue is placed elsewhere; only what runs is waited for).

        An order meant for another process (one this address had before) is refused:
        a fresh worker must not bounce its GPU tasks for its predecessor's restart."""
        if not isinstance(on, bool):
            return {"status": "invalid"}
        if process != self.worker.id:
            logger.warning("accelsched: refused a drain order meant for process %r", process)
            return {"status": "refused"}
        self.draining = on
        return {"status": "OK"}


def under_dask_cuda(worker: Any) -> bool:
    """True for workers started by dask-cuda (LocalCUDACluster, ``dask cuda worker``).

    dask-cuda gives its workers plugins of its own (CPU affinity, RMM setup, ...), and
    only then is ``dask_cuda`` imported in the worker process.
    """
    return "dask_cuda" in sys.modules and any(
        m.startswith("dask_cuda") for m in internals.plugin_modules(worker)
    )
