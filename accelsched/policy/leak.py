"""Is this worker leaking device memory? Decisions only, no distributed import.

NVML sees a process's device memory as one number. Most of it is legitimate: the CUDA
context and library handles (the *baseline*), results the worker still holds (*live*),
and blocks an allocator caches or reserved up front (*retained*). What is left is the
leak estimate; a leak is declared when it stays above the threshold for
``confirmations`` consecutive checks, so a transient spike inside a running task does not
restart anybody, and a big leak is acted on within a few checks.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from accelsched.devices.pool import PoolStats

__all__ = [
    "estimate",
    "Baseline",
    "LeakDetector",
    "LeakReports",
    "Attribution",
    "Verdict",
    "Reclaims",
    "Reclaimed",
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
class Baseline:
    """What a process holds on a device besides its allocations: context, handles.

    Measured as ``process - max(pool.held, live)`` once a context exists: results
    allocated from a known pool are inside ``pool.held`` already, results from an
    allocator no pool reports are not. Lowered when a later reading is smaller (a leak can
    only raise that figure), so memory allocated outside every known pool before the first
    check (by the task that created the context, say) is folded into the baseline.
    """

    value: int | None = None

    def observe(self, process: int, live: int, pool_held: int) -> int:
        candidate = max(0, process - max(live, pool_held))
        if self.value is None or candidate < self.value:
            self.value = candidate
        return self.value


@dataclass(frozen=True)
class Verdict:
    """One check's outcome for one device."""

    device: int
    estimate: int
    threshold: int
    above: int  # consecutive checks above the threshold, this one included
    leak: bool


@dataclass
class LeakDetector:
    """Counts consecutive checks above threshold, per device."""

    confirmations: int = 2
    _above: dict[int, int] = field(default_factory=dict)
    _prefixes: dict[str, int] = field(default_factory=dict)  # prefix -> runs started

    def __post_init__(self) -> None:
        if self.confirmations < 1:
            raise ValueError(f"invalid confirmations={self.confirmations!r}: expected >= 1")

    def ran(self, prefix: str) -> None:
        """Record a task prefix that ran since the last clean check (O(1))."""
        prefixes = self._prefixes
        prefixes[prefix] = prefixes.get(prefix, 0) + 1

    def runs(self) -> dict[str, int]:
        """How many runs of each prefix started since the last clean check."""
        return dict(self._prefixes)

    def check(self, device: int, estimate: int, threshold: int) -> Verdict:
        above = self._above.get(device, 0) + 1 if estimate > threshold else 0
        self._above[device] = above
        return Verdict(device, estimate, threshold, above, above >= self.confirmations)

    def end_check(self, verdicts: Iterable[Verdict], *, complete: bool = True) -> list[str]:
        """Close a round of checks; return the prefixes to blame if any device leaked.

        A complete round (no device skipped) with every device at or below its threshold
        is clean: the prefixes seen so far are forgotten.
        """
        verdicts = list(verdicts)
        blamed = sorted(self._prefixes)
        if complete and all(v.above == 0 for v in verdicts):
            self._prefixes.clear()
        return blamed

    def reset(self, device: int | None = None) -> None:
        """Forget counts (after acting on a leak, so one leak is acted on once)."""
        if device is None:
            self._above.clear()
        else:
            self._above.pop(device, None)


@dataclass
class LeakReports:
    """Which confirmed leaks are news: one ``leak`` event per leak, not one per check.

    While a restart is deferred the same leak is confirmed at every check; it is reported
    once, and again only when it grew by another threshold's worth.
    """

    _reported: dict[int, int] = field(default_factory=dict)  # device -> bytes reported

    def is_news(self, verdict: Verdict) -> bool:
        """Whether to report ``verdict`` (a confirmed leak); remembers it when so."""
        last = self._reported.get(verdict.device)
        if last is not None and verdict.estimate - last < verdict.threshold:
            return False
        self._reported[verdict.device] = verdict.estimate
        return True


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
    the last clean check left nothing is no suspect (:meth:`innocent`), even when no
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

    def innocent(self, runs: dict[str, int]) -> set[str]:
        """The prefixes of ``runs`` (prefix -> runs started) every run of which was seen
        to leave nothing."""
        with self._lock:
            return {p for p, n in runs.items() if self._nothing.get(p, 0) >= n}

    def ranked(self, device: int) -> list[tuple[str, int]]:
        """Prefixes with what they left on ``device``, most first (ties by name)."""
        with self._lock:
            return self._ranked(device)

    def take(self, devices: Iterable[int], *, clear: bool) -> dict[int, list[tuple[str, int]]]:
        """:meth:`ranked` for each of ``devices``; then forgotten, when ``clear``, at once."""
        with self._lock:
            out = {d: self._ranked(d) for d in devices}
            if clear:
                self._bytes.clear()
                self._nothing.clear()
            return out

    def _ranked(self, device: int) -> list[tuple[str, int]]:
        per = self._bytes.get(device, {})
        return sorted(per.items(), key=lambda kv: (-kv[1], kv[0]))

    def clear(self) -> None:
        with self._lock:
            self._bytes.clear()
            self._nothing.clear()


@dataclass(frozen=True)
class Reclaimed:
    """What collecting garbage and freeing pools did to one device's confirmed leak."""

    device: int
    before: int  # the estimate that confirmed the leak
    after: int  # the estimate measured again
    threshold: int

    @property
    def reclaimed(self) -> int:
        return max(0, self.before - self.after)

    @property
    def ended(self) -> bool:
        """The leak is gone: no restart (the estimate is back at or under the threshold)."""
        return self.after <= self.threshold


@dataclass
class Reclaims:
    """Reclaim before restart: when to try, and what a try decided.

    Memory that only a reference cycle holds (a failed task's traceback keeps its frames
    and their device arrays) looks leaked until Python's collector runs, which for old
    objects is rare. On a confirmed leak the guard collects garbage and frees the pools
    first; a restart is asked for only when the estimate measured again is still above
    the threshold.

    A GPU task still in its thread may hold what looks leaked: a failed task's thread
    holds its exception, and the traceback with it, until the worker has handled the
    failure, which can come well after the task released its device (under load,
    hundreds of milliseconds). So a try waits until the GPU tasks executing when the leak
    was confirmed have left their threads, and one check more (the check that sees them
    go may run inside the very transition that ends them), for at most ``max_wait``
    checks. Tasks that start meanwhile do not make it wait longer, and nothing is
    collected while it waits: a full collection costs the worker's event loop.

    A leak that stayed held is not tried again at each confirmation while its restart
    waits: only once the estimate has grown by another threshold since that try.
    """

    max_wait: int = 20
    _held: dict[int, int] = field(default_factory=dict)  # device -> estimate left after a try
    # device -> [keys it waits for, whether they were seen gone, checks waited]
    _waits: dict[int, list[Any]] = field(default_factory=dict)

    def worth_trying(self, device: int, estimate: int, threshold: int) -> bool:
        last = self._held.get(device)
        return last is None or estimate - last >= threshold

    def settled(self, device: int, executing: Iterable[Any]) -> bool:
        """Whether to try on ``device`` now, given the GPU tasks ``executing`` in threads
        (called once per check while its leak is confirmed and worth trying)."""
        running = set(executing)
        wait = self._waits.get(device)
        if wait is None:
            if not running:
                return True
            self._waits[device] = [running, False, 1]
            return False
        waited, seen_gone, checks = wait
        wait[2] = checks + 1
        if checks >= self.max_wait:
            return True
        if waited & running:
            return False
        if not seen_gone:
            wait[1] = True
            return False
        return True

    def forget(self, device: int) -> None:
        """``device`` is clean: a wait for its last leak is over."""
        self._waits.pop(device, None)

    def outcome(self, device: int, before: int, after: int, threshold: int) -> Reclaimed:
        """Record a try on ``device``: ``before`` and ``after`` are its estimates."""
        self._waits.pop(device, None)
        result = Reclaimed(device, before, after, threshold)
        if result.ended:
            self._held.pop(device, None)
        else:
            self._held[device] = after
        return result
