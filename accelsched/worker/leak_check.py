"""The leak check: device memory that nothing legitimate holds, checked periodically.

Live results are tracked as they enter and leave the worker's memory
(:func:`accelsched.devices.arrays.device_nbytes`); each check reads this process's
device memory through NVML, takes off the baseline, live results and pool caches
(:func:`accelsched.policy.leak.estimate`), and lets :class:`~accelsched.policy.leak.LeakDetector`
confirm a leak over consecutive checks. A confirmed leak is reported once
(:class:`~accelsched.policy.leak.LeakReports`) and, with ``restart_on_leak``, the worker asks
for its own lossless restart, unless collecting garbage and freeing the pools gave the
memory back first (:mod:`accelsched.worker.reclaim`, ``leak-reclaimed``). A device that
stops answering NVML is withdrawn once (and offered again when it answers, with
``recover_gpus``) and the worker asks for a restart too.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace
from time import monotonic
from typing import Any

from accelsched import events
from accelsched.config import Threshold
from accelsched.devices.nvml import DeviceInfo, NVMLMonitor
from accelsched.devices.pool import PoolStats, active_pools
from accelsched.policy.health import DeviceHealth
from accelsched.policy.leak import (
    Attribution,
    Baseline,
    LeakDetector,
    LeakReports,
    Reclaims,
    Verdict,
    estimate,
)
from accelsched.policy.leases import LeaseTable
from accelsched.worker.ledger import Ledger, net_of_pools
from accelsched.worker.reclaim import freeze_startup_objects, reclaim

__all__ = ["LeakCheck"]


def complete_and_clean(verdicts: list[Verdict], busy: set[int]) -> bool:
    """A check that looked at every device and found each at or under its threshold."""
    return not busy and all(v.above == 0 for v in verdicts)


class LeakCheck:
    """Live results, baselines and the detector for this worker's owned devices."""

    def __init__(
        self,
        *,
        monitor: NVMLMonitor,
        owned: list[DeviceInfo],
        granted: Callable[[], list[DeviceInfo]],
        leases: LeaseTable,
        used: set[int],
        threshold: Threshold,
        confirmations: int,
        restart_on_leak: bool,
        recover: bool,
        ask_restart: Callable[[str, int], None],
        withdraw: Callable[[int, bool], None],
        emit: Callable[..., None],
        ledger: Ledger,
        simulated: bool = False,
        executing: Callable[[], set[Any]] = set,
    ) -> None:
        self.monitor = monitor
        self.owned = owned
        self._granted = granted
        self.leases = leases
        self.used = used
        self.threshold = threshold
        self.restart_on_leak = restart_on_leak
        self.recover = recover
        self._ask_restart = ask_restart
        self._withdraw = withdraw  # (device, withdrawn?): stop or resume offering it
        self._emit = emit
        self.detector = LeakDetector(confirmations)
        self.reports = LeakReports()
        self.reclaims = Reclaims()
        self.simulated = simulated  # fake GPUs: no CUDA device to make current
        self._executing = executing  # keys of GPU tasks in threads now
        freeze_startup_objects()  # a reclaim's collection scans only what came since
        self.live: dict[Any, dict[int, int]] = {}  # key -> device bytes it holds
        self.live_total: dict[int, int] = {}  # device -> bytes of live results
        self.baselines: dict[int, Baseline] = {}
        self.last_verdicts: list[Verdict] = []
        self.health = DeviceHealth()
        self.ledger = ledger
        self.attribution = Attribution()
        self._attribution_lock = threading.Lock()  # residues come from executor threads
        self.owed = False  # the last check skipped a busy device
        #: Checks completed since setup: tells a reader (a status page, a test waiting
        #: for "no leak") that the check has run since a moment of interest, which the
        #: verdicts alone cannot (they look the same before and after a clean check).
        self.checks: int = 0

    # --- live results (worker event loop) ----------------------------------------------

    def stored(self, key: Any, value: Any, *, arrived: bool = False) -> None:
        """``key`` entered the worker's memory holding ``value``: computed here (measured
        by its task, else known by type) or ``arrived`` from a peer (known by type, else
        measured on its idle devices)."""
        if arrived:
            held = self.ledger.arrived(value, {d.index for d in self.owned} - self._busy())
        else:
            held = self.ledger.held(key, value)
        if held:
            self.live[key] = held
            for d, n in held.items():
                self.live_total[d] = self.live_total.get(d, 0) + n

    def released(self, key: Any) -> None:
        for d, n in self.live.pop(key, {}).items():
            self.live_total[d] = self.live_total.get(d, 0) - n
            self.ledger.forget(d)  # its memory went back unmeasured

    def residue(self, name: str, residues: dict[int, int]) -> None:
        """A step or task (``name``) left these bytes behind per device, beyond its result
        (executor thread)."""
        with self._attribution_lock:
            self.attribution.record(name, residues)

    def ran(self, prefix: str) -> None:
        self.detector.ran(prefix)

    # --- the check -----------------------------------------------------------------------

    def check(self) -> list[Verdict]:
        """One leak check over this process's devices (periodic, on the event loop).

        Devices with a GPU task running are skipped: a task's temporaries are neither
        results nor leaks, and the estimate means nothing until it ends. Which devices are
        busy is read before and after NVML, so a task starting in between is not judged.
        """
        busy = self._busy()
        pools = active_pools()
        verdicts: list[Verdict] = []
        readings = {}
        for dev in self.owned:
            if dev.index in busy:
                continue
            try:
                readings[dev.index] = self.monitor.process_memory(dev.index)
                self.monitor.used(dev.index)  # its memory info, which pools and users read
            except Exception as exc:  # NVMLError: the device stopped answering
                readings.pop(dev.index, None)
                self._unhealthy(dev, exc)
                continue
            if self.health.answered(dev.index):
                self._recovered(dev)
        busy |= self._busy()
        # a device skipped while busy is judged as soon as a task ends (the guard calls
        # check again then): a queue of back-to-back GPU tasks holds it nearly always
        self.owed = any(dev.index in busy and dev.index in self.used for dev in self.owned)
        for dev in self.owned:
            reading = readings.get(dev.index)
            if reading is None or dev.index in busy:
                continue
            if dev.index not in self.used:
                continue  # no GPU task of this worker held it: nothing of ours to judge
            if reading.has_context is False or not reading.attributable:
                continue
            leaked, pool = self._estimate(dev.index, reading.nbytes, pools)
            verdict = self.detector.check(dev.index, leaked, self.threshold.resolve(dev.memory))
            verdicts.append(verdict)
            if verdict.above == 0:  # nothing unexplained: a base for measuring arrivals
                self.ledger.settle(dev.index, net_of_pools(reading.nbytes, pool))
                self.reclaims.forget(dev.index)
        blamed = self.detector.end_check(verdicts, complete=not busy)
        with self._attribution_lock:
            attributed = {v.device: self.attribution.ranked(v.device) for v in verdicts}
            if complete_and_clean(verdicts, busy):
                self.attribution.clear()
        self.last_verdicts = verdicts
        # the prefixes whose runs left memory behind, most first; when no run could be
        # measured, every prefix run since a clean check
        suspects = {
            v.device: [p for p, _ in attributed.get(v.device, [])] or blamed for v in verdicts
        }
        leaks, reclaimed = self._reclaim([v for v in verdicts if v.leak], suspects)
        if leaks:
            for v in leaks:
                if self.reports.is_news(v):
                    ranked = attributed.get(v.device, [])
                    explained = sum(n for _, n in ranked)
                    self._emit(
                        events.LEAK,
                        device=v.device,
                        nbytes=v.estimate,
                        threshold=v.threshold,
                        checks=v.above,
                        prefixes=suspects[v.device],
                        attributed=dict(ranked),
                        unexplained=max(0, v.estimate - explained),
                        reclaimed=reclaimed.get(v.device, 0),
                    )
            self.detector.reset()
            if self.restart_on_leak:
                self._ask_restart("leak", sum(v.estimate for v in leaks))
        self.checks += 1
        return verdicts

    def _estimate(self, device: int, process: int, pools: list) -> tuple[int, PoolStats]:
        """The leak estimate of ``device`` from this process's reading, and its pools."""
        pool = sum((p.stats(device) for p in pools), PoolStats())
        live = self.live_total.get(device, 0)
        baseline = self.baselines.setdefault(device, Baseline()).observe(process, live, pool.held)
        return estimate(process, baseline, live, pool), pool

    def _reclaim(
        self, leaks: list[Verdict], suspects: dict[int, list[str]]
    ) -> tuple[list[Verdict], dict[int, int]]:
        """Reclaim before restart: collect garbage, free pools, measure again.

        Returns the leaks still held, as measured again (a restart is asked for them), and
        what came back per device. A leak that came back is reported (``leak-reclaimed``)
        and its count starts again. A device a task took meanwhile is not judged: its
        count stays, and the check runs again when the task ends.
        """
        worth = [v for v in leaks if self.reclaims.worth_trying(v.device, v.estimate, v.threshold)]
        executing = self._executing() if worth else set()
        tried = [v for v in worth if self.reclaims.settled(v.device, executing)]
        held = [v for v in leaks if v not in worth]
        if not tried:
            return held, {}
        start = monotonic()
        reclaim([v.device for v in tried], simulated=self.simulated)
        came_back: dict[int, int] = {}
        pools = active_pools()
        for v in tried:
            try:
                reading = self.monitor.process_memory(v.device)
            except Exception:  # NVMLError: the next check withdraws it
                held.append(v)
                continue
            if v.device in self._busy():
                self.owed = True
                continue
            after, pool = self._estimate(v.device, reading.nbytes, pools)
            outcome = self.reclaims.outcome(v.device, v.estimate, after, v.threshold)
            came_back[v.device] = outcome.reclaimed
            if not outcome.ended:
                held.append(replace(v, estimate=after))
                continue
            self.detector.reset(v.device)
            self.ledger.settle(v.device, net_of_pools(reading.nbytes, pool))
            self._emit(
                events.LEAK_RECLAIMED,
                device=v.device,
                nbytes=v.estimate,
                reclaimed=outcome.reclaimed,
                remaining=after,
                threshold=v.threshold,
                prefixes=suspects.get(v.device, []),
                seconds=round(monotonic() - start, 4),
            )
        return held, came_back

    def _busy(self) -> set[int]:
        return {d for devices in self.leases.holders().values() for d in devices}

    def _unhealthy(self, dev: DeviceInfo, exc: BaseException) -> None:
        """A verified device stopped answering NVML: withdraw it, once, and restart.

        No new lease lands on it and the worker advertises one GPU fewer (tasks assigned
        against the old count that no longer fit go back to the scheduler); a lossless
        restart re-probes the devices, and the new process reports only those that answer.
        """
        if dev not in self._granted() or not self.health.failed(dev.index):
            return  # not ours to offer, or withdrawn already: said once
        self._emit(events.GPU_UNHEALTHY, device=dev.index, uuid=dev.uuid, error=repr(exc))
        self._withdraw(dev.index, True)
        self._ask_restart("gpu-unhealthy", 0)

    def _recovered(self, dev: DeviceInfo) -> None:
        """A withdrawn device answered long enough
        (:class:`~accelsched.policy.health.DeviceHealth`): offer it again (``recover_gpus``)."""
        if not self.recover:
            self.health.withdrawn.add(dev.index)  # stays out until the worker restarts
            return
        self._emit(events.GPU_RECOVERED, device=dev.index, uuid=dev.uuid)
        self._withdraw(dev.index, False)
