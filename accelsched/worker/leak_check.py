"""The leak check: device memory that nothing legitimate holds, checked periodically.

Each check reads this process's device memory through NVML
(:class:`~accelsched.worker.readings.DeviceReadings`), takes off the baseline, live
results (:class:`~accelsched.worker.results.LiveResults`) and pool caches
(:func:`accelsched.policy.leak.estimate`), and lets
:class:`~accelsched.policy.leak_decisions.LeakDecisions` judge the estimates. Every
decision comes back as proposals, which one actor carries out
(:class:`~accelsched.worker.worker_actor.WorkerActor`): read, decide, act. A confirmed leak is
reported once and, with ``restart_on_leak``, the worker asks for its own lossless
restart, unless collecting garbage and freeing the pools gave the memory back first:
then the devices are read again and the decisions say how it ended. A device that stops
answering NVML is withdrawn once (and offered again when it answers, with
``recover_gpus``); no restart is asked while it fails.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from time import monotonic
from typing import Any

from accelsched.config import Threshold
from accelsched.devices.pool import PoolStats, active_pools
from accelsched.policy.leak import Attribution, Baseline, Verdict, estimate
from accelsched.policy.leak_decisions import LeakDecisions, Remeasured
from accelsched.policy.proposals import Proposal
from accelsched.worker.binder import Binder
from accelsched.worker.ledger import net_of_pools
from accelsched.worker.readings import DeviceReadings
from accelsched.worker.results import LiveResults
from accelsched.worker.worker_actor import WorkerActor

__all__ = ["LeakCheck", "LeakOptions"]


@dataclass(frozen=True)
class LeakOptions:
    """The guard's options the leak check reads (``docs/configuration.md``)."""

    threshold: Threshold
    confirmations: int = 2
    restart_on_leak: bool = True


class LeakCheck:
    """Estimates this worker's owned devices and acts on what the decisions propose."""

    def __init__(
        self,
        *,
        readings: DeviceReadings,
        live: LiveResults,
        binder: Binder,
        options: LeakOptions,
        actor: WorkerActor,
        executing: Callable[[], set[Any]] = set,
        attribution: Attribution | None = None,
    ) -> None:
        self.readings = readings
        self.live = live
        self.leases = binder.leases
        self.used = binder.used  # devices GPU tasks of this worker held
        self.threshold = options.threshold
        self.actor = actor
        self._executing = executing  # keys of GPU tasks in threads now
        self.decisions = LeakDecisions(
            options.confirmations, options.restart_on_leak, attribution=attribution or Attribution()
        )
        #: A task of this prefix started (hot path: the detector's own method, no call more).
        self.ran: Callable[[str], None] = self.decisions.detector.ran
        self.baselines: dict[int, Baseline] = {}
        self.last_verdicts: list[Verdict] = []
        self.owed = False  # the last check skipped a busy device
        #: Checks completed since setup: tells a reader (a status page, a test waiting
        #: for "no leak") that the check has run since a moment of interest, which the
        #: verdicts alone cannot (they look the same before and after a clean check).
        self.checks: int = 0

    def residue(self, name: str, residues: dict[int, int]) -> None:
        """A step or task (``name``) left these bytes behind per device, beyond its result
        (executor thread)."""
        self.decisions.attribution.record(name, residues)

    def check(self) -> list[Verdict]:
        """One leak check over this process's devices (periodic, on the event loop).

        Devices with a GPU task running are skipped: a task's temporaries are neither
        results nor leaks, and the estimate means nothing until it ends. Which devices are
        busy is read before and after NVML, so a task starting in between is not judged.
        """
        busy = self.leases.busy()
        pools = active_pools()
        readings, health = self.readings.take(busy)
        self.actor.apply(health)  # withdrawn before anything is judged
        busy |= self.leases.busy()
        owned, used = self.readings.owned, self.used
        # a device skipped while busy is judged as soon as a task ends (the guard calls
        # check again then): a queue of back-to-back GPU tasks holds it nearly always
        self.owed = any(dev.index in busy and dev.index in used for dev in owned)
        estimates: dict[int, tuple[int, int]] = {}
        settled: dict[int, int] = {}  # device -> its reading net of pools
        for dev in owned:
            reading = readings.get(dev.index)
            if reading is None or dev.index in busy:
                continue
            if dev.index not in used:
                continue  # no GPU task of this worker held it: nothing of ours to judge
            if reading.has_context is False or not reading.attributable:
                continue
            leaked, pool = self._estimate(dev.index, reading.nbytes, pools)
            estimates[dev.index] = (leaked, self.threshold.resolve(dev.memory))
            settled[dev.index] = net_of_pools(reading.nbytes, pool)
        verdicts = self.decisions.count(estimates)
        for v in verdicts:
            if v.above == 0:  # nothing unexplained: a base for measuring arrivals
                self.live.ledger.settle(v.device, settled[v.device])
        self.last_verdicts = verdicts
        # Complete only with no GPU task in a thread: one that has started (its prefix
        # recorded) but not yet taken its lease leaves its device unjudged or unused, and
        # a check then would wrongly clear its prefix as clean (under load, a leak was
        # reported with no suspects).
        complete = not busy and not self._executing()
        proposals = self.decisions.propose(verdicts, complete=complete, executing=self._executing)
        start = monotonic()
        self.actor.apply(proposals)
        if self.decisions.trying:  # collected and freed: measure again, act on the outcome
            self.actor.apply(self._remeasured(self.decisions.trying, start))
        self.checks += 1
        return verdicts

    def _estimate(self, device: int, process: int, pools: list) -> tuple[int, PoolStats]:
        """The leak estimate of ``device`` from this process's reading, and its pools."""
        pool = sum((p.stats(device) for p in pools), PoolStats())
        live = self.live.total.get(device, 0)
        baseline = self.baselines.setdefault(device, Baseline()).observe(process, live, pool.held)
        return estimate(process, baseline, live, pool), pool

    def _remeasured(self, devices: list[int], start: float) -> list[Proposal]:
        """What a reclaim on ``devices`` (begun at ``start``) ended in.

        A device a task took meanwhile is not judged: its count stays, and the check runs
        again when the task ends. One that came back is settled: a base for arrivals.
        """
        pools = active_pools()
        after: dict[int, Remeasured] = {}
        settled: dict[int, int] = {}
        for device in devices:
            reading = self.readings.again(device)
            if reading is None:
                after[device] = Remeasured(None)
                continue
            if device in self.leases.busy():
                self.owed = True
                continue
            leaked, pool = self._estimate(device, reading.nbytes, pools)
            after[device] = Remeasured(leaked, monotonic() - start)
            settled[device] = net_of_pools(reading.nbytes, pool)
        proposals = self.decisions.reclaimed(after)
        ended = {p.subject for p in proposals if p.action == "report-reclaimed"}
        for device, net in settled.items():
            if device in ended:
                self.live.ledger.settle(device, net)
        return proposals
