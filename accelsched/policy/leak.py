"""Is this worker leaking device memory, are its devices healthy, did a task use a GPU
unasked? Decisions only, no distributed import.

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

*Health* (:class:`DeviceHealth`): a device that stops answering NVML is withdrawn at
once. Taking it back at its first answer would let a flapping device withdraw and re-offer
itself, with an event and a restart request each time, at every check. So a device must
answer for a streak of checks first, and each new failure doubles the streak it needs (up
to a ceiling): one glitch costs a few checks, a flapping device stays out. A device a
process left out of its inventory is on probation: asked again with backoff, back under
the same rule, and reported until the scheduler grants it. :func:`judge_answers` turns a
check's NVML answers into proposals; nothing here restarts a worker into a fault it can see.

*Unrequested use* (:func:`classify`): the guard reads this process's device memory before
and after a task that asked for no GPU (only when it ran alone, see
:mod:`accelsched.worker.guard_plugin`). Only this process's own figures count: a device-wide
figure grows with other processes too, and blaming a task for them would be wrong.

*Sampling* (:class:`Backoff`): which runs of a task prefix are measured.

On a device where this process has a CUDA context the guard can measure every GPU task
that holds its devices alone: one NVML process-list read per task (tens to hundreds of
microseconds of CPU; more than a tiny task costs). What the reading buys is attribution
(what each run left behind, by prefix) and the footprint of a result of a type nobody
described. A result whose footprint is known by type needs no reading, so what is left to
learn from a run of a prefix whose runs keep leaving nothing is whether this one, too,
left nothing.

:class:`Backoff` answers that with a sample, kept per prefix and devices (a stretch, below,
is a device's): every run of a prefix is measured until :data:`QUIET_RUNS` measured runs in
a row left nothing, then the gap between measured runs doubles with each further quiet
one, up to :data:`MAX_GAP` runs; and the first run that starts :data:`MAX_WAIT` seconds or
more after the start of the last measured one is measured whatever the gap. The first
measured run that finds something left behind puts the prefix back to every run. The
ledger measures an unmeasured stretch of one prefix's runs as one (its next measured run
reads from the last reading before the stretch), so what any run of the stretch left is
found by the prefix's next measured run there: at most ``MAX_GAP - 1`` runs later, and by
the end of the first run starting :data:`MAX_WAIT` seconds after the leaking one started.

Two bounds, as a reading's cost and the wait for its answer weigh differently with the
length of a run: tiny runs, where a reading costs more than the run, are read once in
:data:`MAX_GAP` or once in :data:`MAX_WAIT` of them, whichever comes first; a prefix
whose runs each last :data:`MAX_WAIT` or more, beside which a reading costs next to
nothing, has each measured.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Collection, Hashable, Iterable, Mapping
from dataclasses import dataclass, field, replace

from accelsched.devices import MemoryReading, PoolStats
from accelsched.policy.proposals import Proposal

__all__ = [
    "Answer",
    "Attribution",
    "Backoff",
    "DeviceHealth",
    "DeviceRecord",
    "LeakDecisions",
    "MAX_GAP",
    "MAX_WAIT",
    "QUIET_RUNS",
    "Remeasured",
    "Suspects",
    "Use",
    "Verdict",
    "classify",
    "estimate",
    "judge_answers",
]


def estimate(process: int, baseline: int, live: int, pool: PoolStats) -> int:
    """Device bytes of this process that nothing legitimate accounts for.

    ``pool.cached`` is releasable and the free part of ``pool.fixed`` (an RMM pool) is
    reserved: both are retained, not leaked. When the pool cannot say how much of its
    reservation is free, live results are assumed to come out of it, so only the part
    they do not fill counts as retained. Leaks inside a fixed pool are invisible to NVML.
    """
    fixed_free = pool.fixed_free if pool.fixed_free is not None else max(0, pool.fixed - live)
    return process - baseline - live - (pool.cached + fixed_free)  # less what is retained


@dataclass
class DeviceRecord:
    """Everything the worker's decisions remember about one device between checks.

    *Health* (:class:`~accelsched.policy.leak.DeviceHealth`): withdrawn or not, how
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

    #: device -> prefix -> bytes its runs left there
    _bytes: defaultdict[int, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    _nothing: Counter[str] = field(default_factory=Counter)  # prefix -> runs that left nothing
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def record(self, prefix: str, residues: dict[int, int]) -> None:
        """What a run of ``prefix`` left behind, per device."""
        with self._lock:
            for device, n in residues.items():
                if n > 0:
                    self._bytes[device][prefix] += n

    def left_nothing(self, prefix: str, runs: int = 1) -> None:
        """``runs`` runs of ``prefix`` were seen to leave nothing on their devices (a
        measured run and the unmeasured stretch it read across, at once)."""
        with self._lock:
            self._nothing[prefix] += runs

    def suspects(
        self, devices: Iterable[int], runs: Mapping[str, int], *, clear: bool
    ) -> dict[int, Suspects]:
        """Whom a leak on each of ``devices`` would blame, ``runs`` (prefix -> runs
        started) being the prefixes that ran since the last clean check: those with a
        residue there, most bytes first (ties by name), else every prefix of ``runs``
        less those every run of which was seen to leave nothing. Then forgotten, when
        ``clear``, at once."""
        with self._lock:
            blamed = tuple(sorted(p for p, n in runs.items() if self._nothing[p] < n))
            out = {
                d: Suspects(tuple(sorted(per.items(), key=lambda kv: (-kv[1], kv[0]))), blamed)
                for d in devices
                for per in [self._bytes.get(d, Counter())]
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
class LeakDecisions:
    """What a leak check remembers between checks, and what it proposes at each.

    ``restart_on_leak``: a leak still held after its reclaim asks for a restart.
    ``max_wait``: the most checks a reclaim waits for GPU tasks to leave their threads.
    """

    confirmations: int = 2
    restart_on_leak: bool = True
    attribution: Attribution = field(default_factory=Attribution)
    max_wait: int = 20
    #: device -> its record (a new one the first time), shared with the health decisions
    devices: defaultdict[int, DeviceRecord] = field(
        default_factory=lambda: defaultdict(DeviceRecord)
    )
    _runs: Counter[str] = field(default_factory=Counter, init=False)  # prefix -> runs started
    #: A reclaim proposed, until its devices are measured again: the leaks it concerns
    #: (confirmed and not tried: a restart is asked for them; tried) and their suspects.
    _round: tuple[list[Verdict], list[Verdict], dict[int, Suspects]] | None = field(
        default=None, init=False
    )

    def __post_init__(self) -> None:
        if self.confirmations < 1:
            raise ValueError(f"invalid confirmations={self.confirmations!r}: expected >= 1")

    def ran(self, prefix: str) -> None:
        """A task of ``prefix`` started: a suspect until the next clean check (O(1), on
        the event loop, as is the clearing: no lock)."""
        self._runs[prefix] += 1

    @property
    def trying(self) -> list[int]:
        """The devices a reclaim was proposed for, until :meth:`reclaimed` hears of them."""
        return [] if self._round is None else [v.device for v in self._round[1]]

    def count(self, estimates: Mapping[int, tuple[int, int]]) -> list[Verdict]:
        """One verdict per device judged: ``estimates`` is device -> (estimate,
        threshold), in the order judged. A device at or under its threshold ends any
        wait for a reclaim there."""
        verdicts = []
        for device, (leaked, threshold) in estimates.items():
            record = self.devices[device]
            record.estimate = leaked
            record.above = record.above + 1 if leaked > threshold else 0
            if not record.above:
                record.waiting_for = None
            confirmed = record.above >= self.confirmations
            verdicts.append(Verdict(device, leaked, threshold, record.above, confirmed))
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
        worth = [v for v in leaks if self.devices[v.device].worth_trying(v.estimate, v.threshold)]
        running = set(executing()) if worth else set()
        tried = [v for v in worth if self.devices[v.device].settled(running, self.max_wait)]
        held = [v for v in leaks if v not in worth]
        if tried:
            self._round = (held, tried, suspects)
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
        held, tried, suspects = pending  # (the round is over: its lists are this call's)
        came_back: dict[int, int] = {}
        out: list[Proposal] = []
        for v in tried:
            if (again := after.get(v.device)) is None:
                continue
            if again.estimate is None:  # NVML did not answer: a leak at the estimate before
                held.append(v)
                continue
            record = self.devices[v.device]
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
                    detail={"prefixes": suspects[v.device].prefixes},
                )
            )
        return out + self._conclude(held, came_back, suspects)

    def _conclude(
        self, held: list[Verdict], came_back: dict[int, int], suspects: dict[int, Suspects]
    ) -> list[Proposal]:
        """Report the held leaks that are news; one restart request for them all (asked
        again at each confirmation: a deferred restart happens once its obstacle goes).
        Every count starts again, so one leak is acted on once."""
        if not held:
            return []
        out = [
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
            for v in held
            if self.devices[v.device].is_news(v.estimate, v.threshold)
            for s in [suspects[v.device]]
        ]
        for record in self.devices.values():
            record.above = 0
        if self.restart_on_leak:
            nbytes = sum(v.estimate for v in held)
            out.append(
                Proposal("ask-restart", tuple(v.device for v in held), "leak", {"nbytes": nbytes})
            )
        return out


@dataclass
class DeviceHealth:
    """Per device (its :class:`~accelsched.policy.leak.DeviceRecord`): withdrawn or not,
    how often it failed, its current good streak; and, for a device left out of the
    inventory, when to try it again.

    Probation: a device left out at a start (often right after a restart its failure
    caused) is probed after ``first`` seconds, and the wait doubles with each failed
    probe up to ``longest``: a dead GPU costs one NVML query now and then, a glitch a few
    seconds. While it answers it is probed at the ``first`` pace, and it is back after
    the same streak as any withdrawn device (a failure meanwhile starts it over, and the
    wait goes on doubling: a flapping device stays out). A device back is due at once, to
    be reported to the scheduler; a report that does not get it granted is one more failed
    try, on the same doubling wait from ``first``, until :meth:`granted`.
    """

    streak: int = 3  # good answers needed after a first failure
    ceiling: int = 96  # most ever needed
    first: float = 1.0  # seconds to the first probe; the pace while a device answers
    longest: float = 30.0  # the most seconds between two probes
    #: device -> its record (the leak decisions share it: one record per device)
    devices: defaultdict[int, DeviceRecord] = field(
        default_factory=lambda: defaultdict(DeviceRecord)
    )

    def __post_init__(self) -> None:
        if self.streak < 1 or self.ceiling < self.streak or not 0 < self.first <= self.longest:
            raise ValueError(
                f"invalid streak={self.streak!r}, ceiling={self.ceiling!r}, "
                f"first={self.first!r}, longest={self.longest!r}"
            )

    @property
    def withdrawn(self) -> set[int]:
        """The devices out of service (not offered)."""
        return {d for d, r in self.devices.items() if r.withdrawn}

    def failed(self, device: int) -> bool:
        """The device did not answer; True when this withdraws it (news, said once)."""
        r = self.devices[device]
        r.good, r.restart_asked = 0, False  # a new failure: once back, ask again
        if r.withdrawn:
            return False
        r.withdrawn, r.failures = True, r.failures + 1
        return True

    def needed(self, device: int) -> int:
        """Good answers in a row the withdrawn ``device`` needs before it is back."""
        return min(self.ceiling, self.streak * 2 ** (max(1, self.devices[device].failures) - 1))

    def answered(self, device: int) -> bool:
        """The device answered; True when this brings a withdrawn device back."""
        r = self.devices[device]
        if not r.withdrawn:
            return False
        r.good += 1
        if r.good < self.needed(device):
            return False
        r.withdrawn, r.good = False, 0
        return True

    # --- probation: devices left out of the inventory -------------------------------

    def left_out(self, device: int, now: float) -> None:
        """``device`` did not answer when the inventory was taken at ``now``."""
        self.failed(device)
        r = self.devices[device]
        r.probe_at, r.probe_wait = now + self.first, min(self.longest, 2 * self.first)

    @property
    def waiting(self) -> list[int]:
        """The devices left out and still out, or back but not granted yet, in order."""
        return self.due(float("inf"))

    def due(self, now: float) -> list[int]:
        """The devices to probe, or to report again, at ``now``, in order."""
        return sorted(
            d for d, r in self.devices.items() if r.probe_at is not None and r.probe_at <= now
        )

    def probe_answered(self, device: int, now: float) -> bool:
        """A probe of ``device`` answered; True when this brings it back (report it now)."""
        r = self.devices[device]
        if r.probe_at is None or not r.withdrawn:
            return False
        back = self.answered(device)
        r.probe_at, r.probe_wait = (now, self.first) if back else (now + self.first, r.probe_wait)
        return back

    def retry(self, device: int, now: float) -> float:
        """A try at ``device`` failed at ``now``: a probe (its streak starts over) or a
        report not granted. Returns the wait before the next try (0: not on probation);
        the wait after doubles."""
        r = self.devices[device]
        if r.probe_at is None:
            return 0.0
        if r.withdrawn:
            self.failed(device)
        wait = r.probe_wait
        r.probe_at, r.probe_wait = now + wait, min(self.longest, 2 * wait)
        return wait

    def granted(self, device: int) -> None:
        """The scheduler granted ``device`` back: off probation."""
        self.devices[device].probe_at = None


@dataclass(frozen=True)
class Answer:
    """How one device answered a check's NVML query."""

    device: int
    uuid: str
    error: str | None = None  # the repr of what NVML raised; None: it answered
    granted: bool = True  # the scheduler granted it to this worker: only then withdrawn


def judge_answers(
    health: DeviceHealth, answers: Iterable[Answer], *, recover: bool
) -> list[Proposal]:
    """What a check's answers call for, device by device in the order asked.

    A granted device that stops answering is withdrawn once (however many checks see it
    fail): no new lease lands on it and the worker advertises one GPU fewer, but it keeps
    serving its other devices and CPU work. It does NOT ask for a restart: a fault NVML
    shows now is the device's or the driver's, which a new process does not cure (a GPU
    off the bus stays lost), and a new process started during it may not start at all
    (distributed's own GPU diagnostics query the first visible device as it starts). So
    the worker waits for the device to answer. One that answered long enough (the streak
    :class:`DeviceHealth` requires) comes back in this process when ``recover``
    (``recover_gpus``); without it, only then does the worker ask for a restart (reason
    ``gpu-unhealthy``), into a device that answers: the new process verifies it again.
    """
    out: list[Proposal] = []
    for a in answers:
        if a.error is not None:
            if a.granted and health.failed(a.device):
                detail = {"uuid": a.uuid, "error": a.error}
                out.append(Proposal("withdraw", a.device, "gpu-unhealthy", detail=detail))
        elif health.answered(a.device):
            if recover:
                out.append(Proposal("recover", a.device, detail={"uuid": a.uuid}))
            else:  # out of this process; a restart takes it back, now that it answers
                r = health.devices[a.device]
                r.withdrawn = True
                if not r.restart_asked:  # once: the restart is the cure
                    r.restart_asked = True
                    out.append(Proposal("ask-restart", (a.device,), "gpu-unhealthy", {"nbytes": 0}))
    return out


@dataclass(frozen=True)
class Use:
    """GPU use found on one device: memory growth and/or a new CUDA context."""

    device: int
    nbytes: int  # growth of this process's device memory (0 when it only made a context)
    context_created: bool


def classify(before: Mapping[int, MemoryReading], after: Mapping[int, MemoryReading]) -> list[Use]:
    """The devices an unannotated task used, from readings taken around it."""
    found: list[Use] = []
    for device, now in after.items():
        then = before.get(device)
        if then is None or not (now.exact and then.exact):
            continue  # not this process's own figure: another process may have grown
        grew = now.nbytes - then.nbytes
        created = bool(now.has_context) and then.has_context is False
        if grew > 0 or created:
            found.append(Use(device, max(grew, 0), created))
    return found


#: Measured runs in a row that left nothing before a prefix's runs are sampled.
QUIET_RUNS = 4
#: A sampled prefix has at most this many runs from one measured run to the next
#: (``MAX_GAP - 1`` unmeasured between them). A reading costs a busy worker a few hundred
#: microseconds of CPU, half of what it spends on a tiny task or so: one in 64 of them
#: made the readings most of a percent of its CPU, a large part of the guard's budget of
#: five. Bound at 1024, tiny runs are read by :data:`MAX_WAIT` first (unless more than
#: 4096 runs of one prefix start a second on one device): about four readings a second.
MAX_GAP = 1024
#: Seconds from the start of a prefix's measured run after which its next run is
#: measured, whatever the gap: a prefix whose runs each last this long has each measured,
#: and a stretch of unmeasured runs ends at the first run starting this long after.
MAX_WAIT = 0.25
#: Prefixes remembered; beyond this the record starts over (every prefix measured again).
MAX_PREFIXES = 10_000


class Backoff:
    """Per prefix (the ledger's key: the prefix and the devices a run holds, as a stretch
    of unmeasured runs is a device's): how many runs to let pass unmeasured before the
    next measured one, and until when (``clock``'s seconds).

    Called from the tasks' threads without a lock: two runs of one prefix racing can at
    worst measure one run more or one fewer, never skip past :attr:`max_gap`'s bound by
    more than the runs in flight at once.
    """

    __slots__ = ("quiet", "max_gap", "max_wait", "clock", "_state")

    def __init__(
        self,
        quiet: int = QUIET_RUNS,
        max_gap: int = MAX_GAP,
        max_wait: float = MAX_WAIT,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if quiet < 1 or max_gap < 1 or not max_wait > 0:
            raise ValueError(
                f"quiet and max_gap must be at least 1 and max_wait above 0, not {quiet}, "
                f"{max_gap}, {max_wait}"
            )
        self.quiet = quiet
        self.max_gap = max_gap
        self.max_wait = max_wait
        self.clock = clock
        # prefix -> [quiet measured runs in a row, gap, runs still to pass unmeasured,
        # the clock's time from which a run is measured: the last measured one's start
        # and max_wait]
        self._state: dict[Hashable, list[float]] = {}

    def measure(self, prefix: Hashable) -> bool:
        """Whether this run of ``prefix`` is measured (asked once per run, as it starts)."""
        state = self._state.get(prefix)
        if state is None:
            return True
        now = self.clock()
        if state[2] <= 0 or now >= state[3]:
            # due until measured() says it was (a run that could not be measured, not
            # alone on its devices, say, leaves the next run due)
            state[2], state[3] = 0, now + self.max_wait
            return True
        state[2] -= 1
        return False

    def measured(self, prefix: Hashable, left: bool) -> None:
        """A measured run of ``prefix`` (with the unmeasured ones before it) ``left``
        something behind, or nothing."""
        if left:
            self._state.pop(prefix, None)  # every run measured again
            return
        state = self._state.get(prefix)
        if state is None:
            if len(self._state) >= MAX_PREFIXES:
                self._state.clear()
            # (from now, not this run's start: later runs set it as they start)
            state = self._state[prefix] = [0, 1, 0, self.clock() + self.max_wait]
        state[0] += 1
        if state[0] >= self.quiet:
            state[1] = min(self.max_gap, state[1] * 2)
        state[2] = state[1] - 1

    def reset(self, prefix: Hashable) -> None:
        """Measure every run of ``prefix`` again (a run could not be measured when its
        result needed it)."""
        self._state.pop(prefix, None)

    def gap(self, prefix: Hashable) -> int:
        """Runs from one measured run of ``prefix`` to the next, now (at most)."""
        return int(self._state.get(prefix, (0, 1))[1])
