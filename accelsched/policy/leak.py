"""Is this worker leaking device memory? Decisions only, no distributed import.

NVML sees a process's device memory as one number. Most of it is legitimate: the CUDA
context and library handles (the *baseline*), results the worker still holds (*live*),
and blocks an allocator caches or reserved up front (*retained*). What is left is the
leak estimate (:func:`estimate`); a leak is declared when it stays above the threshold
for ``confirmations`` consecutive checks, so a transient spike inside a running task does
not restart anybody, and a big leak is acted on within a few checks.

A confirmed leak is first *reclaimed* (garbage collected, pools freed) where that is
worth a try; only the devices measured again after the try decide between
``report-reclaimed`` and a ``report-leak`` with a restart request. :class:`LeakDecisions`
answers each check with :class:`~accelsched.policy.proposals.Proposal` objects that the
worker's one actor carries out. What the worker's decisions remember of a device
between checks (its health, its probation, its leak) is one :class:`DeviceRecord`.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable, Collection, Hashable, Iterable, Mapping
from dataclasses import dataclass, field, replace

from accelsched.devices.pool import PoolStats
from accelsched.policy.proposals import Proposal

__all__ = [
    "estimate",
    "Attribution",
    "DeviceRecord",
    "LeakDecisions",
    "Remeasured",
    "Suspects",
    "Verdict",
]


def estimate(process: int, baseline: int, live: int, pool: PoolStats) -> int:
    """Device bytes of this process that nothing legitimate accounts for.

    ``pool.cached`` is releasable and the free part of ``pool.fixed`` (an RMM pool) is
    reserved: both are retained, not leaked. When the pool cannot say how much of its
    reservation is free, live results are assumed to come out of it, so only the part
    they do not fill counts as retained. Leaks inside a fixed pool are invisible to NVML.
    """
    fixed_free = pool.fixed_free if pool.fixed_free is not None else max(0, pool.fixed - live)
    retained = pool.cached + fixed_free
    return process - baseline - live - retained


@dataclass
class DeviceRecord:
    """Everything the worker's decisions remember about one device between checks.

    *Health* (:class:`~accelsched.policy.health.DeviceHealth`): withdrawn or not, how
    often it failed, its good answers in a row since, and for a device left out of the
    inventory (on probation) when to probe or report it again. The rest is its leak's.

    *Reported*: while a restart is deferred the same leak is confirmed at every check; it
    is reported once, and again only when it grew by another threshold's worth.

    *Reclaim before restart*: memory that only a reference cycle holds (a failed task's
    traceback keeps its frames and their device arrays) looks leaked until Python's
    collector runs, which for old objects is rare. A GPU task still in its thread may
    hold it too: a failed task's thread holds its exception until the worker has handled
    the failure, well after the task released its device (under load, hundreds of
    milliseconds). So a try waits until the GPU tasks executing at the confirmation have
    left their threads, and one check more (the check that sees them go may run inside
    the very transition that ends them), for at most ``max_wait`` checks; tasks that
    start meanwhile do not make it wait longer. A leak that stayed held (``kept``) is not
    tried again at each confirmation while its restart waits: only once the estimate has
    grown by another threshold since that try.
    """

    failures: int = 0  # times withdrawn
    good: int = 0  # answers in a row while withdrawn
    withdrawn: bool = False  # failing NVML (or not steady yet): not offered
    restart_asked: bool = False  # back, kept out: restart asked
    probe_at: float | None = None  # when to ask NVML again (None: not on probation)
    probe_wait: float = 0.0  # the wait after its next failed probe
    baseline: int | None = None  # context and handles: the smallest footprint seen
    estimate: int | None = None  # the last one judged (a busy device is not)
    above: int = 0  # consecutive checks above the threshold
    reported: int | None = None  # the estimate last reported as a leak
    kept: int | None = None  # the estimate a reclaim left above the threshold
    waiting_for: frozenset[Hashable] | None = None  # GPU tasks in threads at confirmation
    seen_gone: bool = False  # ...and a check has seen them gone
    waited: int = 0  # checks waited

    def observe_baseline(self, process: int, live: int, pool_held: int) -> int:
        """The baseline, lowered to ``process - max(pool_held, live)`` if that is smaller.

        Results allocated from a known pool are inside ``pool_held`` already, results
        from an allocator no pool reports are not. A leak can only raise that figure, so
        memory allocated outside every known pool before the first check (by the task
        that created the context, say) is folded into the baseline.
        """
        candidate = max(0, process - max(live, pool_held))
        if self.baseline is None or candidate < self.baseline:
            self.baseline = candidate
        return self.baseline

    def is_news(self, estimate: int, threshold: int) -> bool:
        """Whether a confirmed leak at ``estimate`` is to be reported (none reported yet,
        or it grew by another threshold's worth since); remembers it so."""
        if self.reported is not None and estimate - self.reported < threshold:
            return False
        self.reported = estimate
        return True

    def worth_trying(self, estimate: int, threshold: int) -> bool:
        """Whether to try a reclaim: none left this leak held, or it grew by another
        threshold's worth since."""
        return self.kept is None or estimate - self.kept >= threshold

    def settled(self, executing: Collection[Hashable], max_wait: int) -> bool:
        """Whether to try a reclaim now, given the GPU tasks ``executing`` in threads
        (asked once per check while the leak is confirmed and worth trying)."""
        if self.waiting_for is None:
            if not executing:
                return True
            self.waiting_for, self.seen_gone, self.waited = frozenset(executing), False, 1
            return False
        self.waited += 1
        if self.waited > max_wait:
            return True
        if self.waiting_for & set(executing):
            return False
        gone_before, self.seen_gone = self.seen_gone, True
        return gone_before

    def tried(self, before: int, after: int, threshold: int) -> tuple[int, bool]:
        """A reclaim took the estimate from ``before`` to ``after``: the bytes it gave
        back, and whether that ended the leak (back at or under the threshold)."""
        self.waiting_for = None
        ended = after <= threshold
        self.kept = None if ended else after
        return max(0, before - after), ended


@dataclass(frozen=True)
class Verdict:
    """One check's outcome for one device."""

    device: int
    estimate: int
    threshold: int
    above: int  # consecutive checks above the threshold, this one included
    leak: bool


@dataclass(frozen=True)
class Suspects:
    """Whom a leak on one device blames.

    ``ranked``: the steps or task prefixes whose measured runs left memory behind on the
    device since the last clean check, with those bytes, most first. When none did,
    ``blamed``: every task prefix that ran on the worker since then, by name, less those
    every run of which was seen to leave nothing (never an innocent step: with none
    left, no suspect at all).
    """

    ranked: tuple[tuple[str, int], ...] = ()
    blamed: tuple[str, ...] = ()

    @property
    def prefixes(self) -> tuple[str, ...]:
        return tuple(p for p, _ in self.ranked) or self.blamed


@dataclass
class Attribution:
    """Which task prefixes left device memory behind that nothing holds.

    A GPU task's *residue* is what its run added to its device beyond the result it
    returned (measured growth minus the result's known size). Residues add up per
    prefix until a clean check; a leak event names the prefixes ranked by bytes.
    Residues are recorded from the tasks' threads while a check reads them on the event
    loop: a lock keeps a residue from landing between a check's reading and its clearing.

    A run seen to leave nothing at all on its devices (measured with no growth, or with
    no CUDA context before or after it) is counted too: a prefix all of whose runs since
    the last clean check left nothing is no suspect (:meth:`suspects`), even when no
    measured run explains a leak (the leaking task made the device's first context, so
    nothing could measure it).
    """

    _bytes: dict[int, dict[str, int]] = field(default_factory=dict)  # device -> prefix -> n
    _nothing: dict[str, int] = field(default_factory=dict)  # prefix -> runs that left nothing
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def record(self, prefix: str, residues: dict[int, int]) -> None:
        """What a run of ``prefix`` left behind, per device."""
        with self._lock:
            for device, n in residues.items():
                if n > 0:
                    per = self._bytes.setdefault(device, {})
                    per[prefix] = per.get(prefix, 0) + n

    def left_nothing(self, prefix: str) -> None:
        """A run of ``prefix`` was seen to leave nothing on its devices."""
        with self._lock:
            self._nothing[prefix] = self._nothing.get(prefix, 0) + 1

    def suspects(
        self, devices: Iterable[int], runs: Mapping[str, int], *, clear: bool
    ) -> dict[int, Suspects]:
        """Whom a leak on each of ``devices`` would blame, ``runs`` (prefix -> runs
        started) being the prefixes that ran since the last clean check: those with a
        residue there, most bytes first (ties by name), else every prefix of ``runs``
        less those every run of which was seen to leave nothing. Then forgotten, when
        ``clear``, at once."""
        with self._lock:
            blamed = tuple(sorted(p for p, n in runs.items() if self._nothing.get(p, 0) < n))
            out = {
                d: Suspects(tuple(sorted(per.items(), key=lambda kv: (-kv[1], kv[0]))), blamed)
                for d in devices
                for per in [self._bytes.get(d, {})]
            }
            if clear:
                self._bytes.clear()
                self._nothing.clear()
            return out


@dataclass(frozen=True)
class Remeasured:
    """A device's estimate measured again after a reclaim."""

    estimate: int | None  # None: NVML did not answer (the next check withdraws it)
    seconds: float = 0.0  # collecting, freeing and measuring again


@dataclass
class _Round:
    """A reclaim proposed: the leaks it concerns, until their devices are measured again."""

    held: list[Verdict]  # confirmed, not tried: a restart is asked for them
    tried: list[Verdict]
    suspects: dict[int, Suspects]


@dataclass
class LeakDecisions:
    """What a leak check remembers between checks, and what it proposes at each.

    ``restart_on_leak``: a leak still held after its reclaim asks for a restart.
    ``max_wait``: the most checks a reclaim waits for GPU tasks to leave their threads.
    """

    confirmations: int = 2
    restart_on_leak: bool = True
    attribution: Attribution = field(default_factory=Attribution)
    max_wait: int = 20
    #: device -> its record, shared with the health decisions (one record per device)
    devices: defaultdict[int, DeviceRecord] = field(
        default_factory=lambda: defaultdict(DeviceRecord)
    )
    _runs: dict[str, int] = field(default_factory=dict, init=False)  # prefix -> runs started
    _round: _Round | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.confirmations < 1:
            raise ValueError(f"invalid confirmations={self.confirmations!r}: expected >= 1")

    def device(self, index: int) -> DeviceRecord:
        """What is remembered about device ``index`` (a new record the first time)."""
        return self.devices[index]

    def ran(self, prefix: str) -> None:
        """A task of ``prefix`` started: a suspect until the next clean check (O(1), on
        the event loop, as is the clearing: no lock)."""
        runs = self._runs
        runs[prefix] = runs.get(prefix, 0) + 1

    @property
    def trying(self) -> list[int]:
        """The devices a reclaim was proposed for, until :meth:`reclaimed` hears of them."""
        return [] if self._round is None else [v.device for v in self._round.tried]

    def count(self, estimates: Mapping[int, tuple[int, int]]) -> list[Verdict]:
        """One verdict per device judged: ``estimates`` is device -> (estimate,
        threshold), in the order judged. A device at or under its threshold ends any
        wait for a reclaim there."""
        verdicts = []
        for device, (leaked, threshold) in estimates.items():
            record = self.device(device)
            record.estimate = leaked
            record.above = record.above + 1 if leaked > threshold else 0
            if not record.above:
                record.waiting_for = None
            leak = record.above >= self.confirmations
            verdicts.append(Verdict(device, leaked, threshold, record.above, leak))
        return verdicts

    def suspects(self, verdicts: list[Verdict], *, complete: bool) -> dict[int, Suspects]:
        """Whom a leak on each device of ``verdicts`` blames. A ``complete`` check (no
        device skipped for a running GPU task) with every device at or under its
        threshold is clean: the suspects are forgotten."""
        clean = complete and all(v.above == 0 for v in verdicts)
        suspects = self.attribution.suspects([v.device for v in verdicts], self._runs, clear=clean)
        if clean:
            self._runs.clear()
        return suspects

    def propose(
        self,
        verdicts: list[Verdict],
        *,
        complete: bool,
        executing: Callable[[], Collection[Hashable]] = set,
    ) -> list[Proposal]:
        """What this check's ``verdicts`` call for.

        ``complete``: as for :meth:`suspects`. ``executing`` gives the GPU tasks in their
        threads now, asked only when a reclaim is worth trying (it waits for them).
        Proposes ``reclaim`` for the leaks to try (then :meth:`reclaimed` decides, once
        measured again), else the leaks' reports and restart request.
        """
        suspects = self.suspects(verdicts, complete=complete)
        leaks = [v for v in verdicts if v.leak]
        worth = [v for v in leaks if self.device(v.device).worth_trying(v.estimate, v.threshold)]
        running = set(executing()) if worth else set()
        tried = [v for v in worth if self.device(v.device).settled(running, self.max_wait)]
        held = [v for v in leaks if v not in worth]
        if tried:
            self._round = _Round(held, tried, suspects)
            return [Proposal("reclaim", v.device) for v in tried]
        self._round = None
        return self._conclude(held, {}, suspects)

    def reclaimed(self, after: Mapping[int, Remeasured]) -> list[Proposal]:
        """What the reclaim proposed last decided, given its devices measured again.

        A device missing from ``after`` was taken by a GPU task meanwhile: not judged now
        (the check runs again when the task ends). One back at or under its threshold is
        reported as reclaimed and its count starts again; one still above is a leak, at
        its new estimate, and so is one NVML did not answer, at the estimate before.
        """
        pending, self._round = self._round, None
        if pending is None:
            return []
        held = list(pending.held)
        came_back: dict[int, int] = {}
        out: list[Proposal] = []
        for v in pending.tried:
            again = after.get(v.device)
            if again is None:
                continue
            if again.estimate is None:
                held.append(v)
                continue
            record = self.device(v.device)
            came_back[v.device], ended = record.tried(v.estimate, again.estimate, v.threshold)
            if not ended:
                held.append(replace(v, estimate=again.estimate))
                continue
            record.above = 0
            out.append(
                Proposal(
                    "report-reclaimed",
                    v.device,
                    figures={
                        "nbytes": v.estimate,
                        "reclaimed": came_back[v.device],
                        "remaining": again.estimate,
                        "threshold": v.threshold,
                        "seconds": round(again.seconds, 4),
                    },
                    detail={"prefixes": pending.suspects[v.device].prefixes},
                )
            )
        return out + self._conclude(held, came_back, pending.suspects)

    def _conclude(
        self, held: list[Verdict], came_back: dict[int, int], suspects: dict[int, Suspects]
    ) -> list[Proposal]:
        """Report the held leaks that are news; one restart request for them all (asked
        again at each confirmation: a deferred restart happens once its obstacle goes).
        Every count starts again, so one leak is acted on once."""
        if not held:
            return []
        out: list[Proposal] = []
        for v in held:
            if not self.device(v.device).is_news(v.estimate, v.threshold):
                continue
            s = suspects[v.device]
            out.append(
                Proposal(
                    "report-leak",
                    v.device,
                    figures={
                        "nbytes": v.estimate,
                        "threshold": v.threshold,
                        "checks": v.above,
                        "unexplained": max(0, v.estimate - sum(n for _, n in s.ranked)),
                        "reclaimed": came_back.get(v.device, 0),
                    },
                    detail={"prefixes": s.prefixes, "attributed": s.ranked},
                )
            )
        for record in self.devices.values():
            record.above = 0
        if self.restart_on_leak:
            nbytes = sum(v.estimate for v in held)
            out.append(
                Proposal("ask-restart", tuple(v.device for v in held), "leak", {"nbytes": nbytes})
            )
        return out
