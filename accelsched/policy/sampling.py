"""Which runs of a task prefix are measured. Decisions only, no distributed import.

On a device where this process has a CUDA context the guard can measure every GPU task
that holds its devices alone: one NVML process-list read per task (tens to hundreds of
microseconds of CPU; more than a tiny task costs). What the reading buys is attribution
(what each run left behind, by prefix) and the footprint of a result of a type nobody
described. A result whose footprint is known by type needs no reading, so what is left to
learn from a run of a prefix whose runs keep leaving nothing is whether this one, too,
left nothing.

:class:`Backoff` answers that with a sample: every run of a prefix is measured until
:data:`QUIET_RUNS` measured runs in a row left nothing, then the gap between measured runs
doubles with each further quiet one, up to :data:`MAX_GAP`. The first measured run that
finds something left behind puts the prefix back to every run. The ledger measures an
unmeasured stretch of one prefix's runs as one (its next measured run reads from the last
reading before the stretch), so what any run of the stretch left is found by the
prefix's next measured run, at most :data:`MAX_GAP` runs later.
"""

from __future__ import annotations

__all__ = ["Backoff", "QUIET_RUNS", "MAX_GAP"]

#: Measured runs in a row that left nothing before a prefix's runs are sampled.
QUIET_RUNS = 4
#: A sampled prefix has at most this many runs from one measured run to the next
#: (``MAX_GAP - 1`` unmeasured between them).
MAX_GAP = 16
#: Prefixes remembered; beyond this the record starts over (every prefix measured again).
MAX_PREFIXES = 10_000


class Backoff:
    """Per prefix: how many runs to let pass unmeasured before the next measured one.

    Called from the tasks' threads without a lock: two runs of one prefix racing can at
    worst measure one run more or one fewer, never skip past :attr:`max_gap`'s bound by
    more than the runs in flight at once.
    """

    __slots__ = ("quiet", "max_gap", "_state")

    def __init__(self, quiet: int = QUIET_RUNS, max_gap: int = MAX_GAP) -> None:
        if quiet < 1 or max_gap < 1:
            raise ValueError(f"quiet and max_gap must be at least 1, not {quiet}, {max_gap}")
        self.quiet = quiet
        self.max_gap = max_gap
        # prefix -> [quiet measured runs in a row, gap, runs still to pass unmeasured]
        self._state: dict[str, list[int]] = {}

    def measure(self, prefix: str) -> bool:
        """Whether this run of ``prefix`` is measured (asked once per run)."""
        state = self._state.get(prefix)
        if state is None or state[2] <= 0:
            return True
        state[2] -= 1
        return False

    def measured(self, prefix: str, left: bool) -> None:
        """A measured run of ``prefix`` (with the unmeasured ones before it) ``left``
        something behind, or nothing."""
        if left:
            self._state.pop(prefix, None)  # every run measured again
            return
        state = self._state.get(prefix)
        if state is None:
            if len(self._state) >= MAX_PREFIXES:
                self._state.clear()
            state = self._state[prefix] = [0, 1, 0]
        state[0] += 1
        if state[0] >= self.quiet:
            state[1] = min(self.max_gap, state[1] * 2)
        state[2] = state[1] - 1

    def reset(self, prefix: str) -> None:
        """Measure every run of ``prefix`` again (a run could not be measured when its
        result needed it)."""
        self._state.pop(prefix, None)

    def gap(self, prefix: str) -> int:
        """Runs from one measured run of ``prefix`` to the next, now."""
        state = self._state.get(prefix)
        return 1 if state is None else state[1]
