"""The leak check: device memory that nothing legitimate holds, checked periodically.

Each check reads, through NVML, every owned device no GPU task holds: this process's
memory there, and the device's memory info (what pools and users read). It takes off
the baseline, live results (:meth:`~accelsched.worker.ledger.Ledger.live`) and pool caches
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
"""

from __future__ import annotations

import gc
import itertools
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from time import monotonic
from typing import TYPE_CHECKING, Any

from accelsched import events
from accelsched.config import Threshold
from accelsched.devices.gpu_memory import PoolStats, active_pools
from accelsched.devices.nvml import MemoryReading
from accelsched.policy.leak import (
    Answer,
    LeakDecisions,
    Remeasured,
    Verdict,
    estimate,
    judge_answers,
)
from accelsched.policy.proposals import Proposal
from accelsched.protocol import GuardMetric, ReportReply
from accelsched.worker.ledger import Ledger, net_of_pools
from accelsched.worker.pool_freer import reclaim

if TYPE_CHECKING:
    from accelsched.worker.binder import Binder
    from accelsched.worker.inventory import Inventory

__all__ = ["LeakCheck", "WorkerActor"]

logger = logging.getLogger(__name__)


class LeakCheck:
    """Reads this worker's owned devices, estimates their leaks and acts on what the
    decisions propose; each option is the guard's (``docs/configuration.md``)."""

    def __init__(
        self,
        *,
        inventory: Inventory,
        binder: Binder,
        ledger: Ledger,
        actor: WorkerActor,
        decisions: LeakDecisions,
        threshold: Threshold,
        recover: bool = True,
    ) -> None:
        # the inventory's devices (its lists, kept up to date in place) and their health
        # records, which ``decisions`` share; the binder's leases and used devices
        self._inventory = inventory
        self._binder = binder
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
        inv, leases = self._inventory, self._binder.leases
        monitor, owned = inv.monitor, inv.owned
        busy = leases.busy()
        pools = active_pools()
        # each owned device not busy, read; what the answers call for (withdraw, recover,
        # ask for a restart) is done before anything is judged
        readings: dict[int, MemoryReading] = {}
        answers: list[Answer] = []
        for dev in owned:
            if dev.index in busy:
                continue
            try:
                readings[dev.index] = monitor.process_memory(dev.index)
                monitor.used(dev.index)
            except Exception as exc:  # NVMLError: the device stopped answering
                readings.pop(dev.index, None)
                # one not granted is not ours to offer: nothing to withdraw
                answers.append(
                    Answer(dev.index, dev.uuid, error=repr(exc), granted=dev in inv.granted)
                )
                continue
            answers.append(Answer(dev.index, dev.uuid))
        self._actor.apply(judge_answers(inv.health, answers, recover=self._recover))
        busy |= leases.busy()
        used = self._binder.used
        # a device skipped while busy is judged as soon as a task ends (the guard calls
        # check again then): a queue of back-to-back GPU tasks holds it nearly always
        self.owed = any(dev.index in busy and dev.index in used for dev in owned)
        limits = {dev.index: self._threshold.resolve(dev.memory) for dev in owned}
        estimates: dict[int, tuple[int, int]] = {}
        for device, reading in readings.items():
            # running, no GPU task of this worker held it, or no figure of this process's own
            # there: nothing to judge
            if (
                device in busy
                or device not in used
                or reading.has_context is False
                or not reading.attributable
            ):
                continue
            limit = limits[device]
            estimates[device] = (self._estimate(device, reading.nbytes, pools, limit), limit)
        verdicts = self.last_verdicts = self._decisions.count(estimates)
        # Complete only with no GPU task in a thread: one that has started (its prefix
        # recorded) but not yet taken its lease leaves its device unjudged or unused, and
        # a check then would wrongly clear its prefix as clean (under load, a leak was
        # reported with no suspects).
        complete = not busy and not leases.gpu_keys()
        proposals = self._decisions.propose(verdicts, complete=complete, executing=leases.gpu_keys)
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
        baseline = self._decisions.device(device).observe_baseline(process, live, pool.held)
        leaked = estimate(process, baseline, live, pool)
        if leaked <= limit:
            self._ledger.settle(device, net_of_pools(process, pool))
        return leaked

    def heartbeat_metric(self, worker: Any = None) -> GuardMetric:
        """Leases in use and leak estimates of the granted devices, for ``accelsched
        status`` and the dashboard page (distributed calls it with the worker at each
        heartbeat; O(devices + running GPU tasks)). A device a GPU task holds is not
        judged (its temporaries are no leak): its estimate is the last one made."""
        leases, inv = self._binder.leases, self._inventory
        held = Counter(d for devices in leases.holders().values() for d in devices)
        withdrawn, declared = inv.health.withdrawn, leases.declared()
        return {
            "devices": [
                {
                    "index": dev.index,
                    "leases": held.get(dev.index, 0),
                    "withdrawn": dev.index in withdrawn,
                    "leak_estimate": self._decisions.device(dev.index).estimate,
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
        """No new lease lands on the device and the worker advertises one GPU fewer
        (tasks assigned against the old count that no longer fit go back)."""
        self._emit(events.GPU_UNHEALTHY, device=p.subject, **p.detail)  # uuid, error
        self._offer()

    def recover(self, p: Proposal) -> None:
        self._emit(events.GPU_RECOVERED, device=p.subject, **p.detail)  # uuid
        self._offer()

    def _offer(self) -> None:
        """Offer what is usable now (the health record says which devices are out):
        leases at once, the count right after."""
        self._set_devices(self.inventory.usable)
        self._spawn(self.inventory.offer, self._set_devices)

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
            if index not in monitor.left_out:  # back, not granted yet: report it again
                report = True
                continue
            try:
                info = monitor.query(index)
            except Exception:  # NVMLError: still out
                health.retry(index, now)
                continue
            if health.probe_answered(index, now):
                self.inventory.rejoin(info)
                report = True
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
