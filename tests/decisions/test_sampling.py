"""Which runs of a task prefix the ledger measures on a device with a context
(:class:`accelsched.policy.leak.Backoff`), with numbers: every run until runs keep
leaving nothing, then a sample backing off to one run in :data:`MAX_GAP`, or one run
:data:`MAX_WAIT` seconds after the last measured one if that comes first; the first run
found leaving something puts the prefix back to every run."""

from __future__ import annotations

import math

import pytest

from accelsched.policy import leak as leak_policy
from accelsched.policy.leak import MAX_GAP, MAX_WAIT, QUIET_RUNS, Backoff


class Runs:
    """A clock that moves ``seconds`` per run (0: time stands still, the run count's rule
    alone decides)."""

    def __init__(self, seconds: float = 0.0) -> None:
        self.seconds = seconds
        self.run = 0

    def __call__(self) -> float:
        return self.run * self.seconds


def measured_runs(
    b: Backoff,
    prefix: str,
    runs: int,
    left_at: frozenset[int] = frozenset(),
    clock: Runs | None = None,
) -> list[int]:
    """The runs (1-based) ``b`` measures; a measured run numbered in ``left_at``, or one
    measured after an unmeasured run so numbered, finds something left behind. ``clock``:
    ``b``'s, moved on to each run's number."""
    out, pending = [], False
    for run in range(1, runs + 1):
        if clock is not None:
            clock.run = run
        pending = pending or run in left_at
        if b.measure(prefix):
            out.append(run)
            b.measured(prefix, pending)
            pending = False
    return out


def test_every_run_until_quiet_then_doubling_gaps_up_to_the_bound() -> None:
    assert (QUIET_RUNS, MAX_GAP, MAX_WAIT) == (4, 1024, 0.25)
    b = Backoff(clock=Runs())
    got = measured_runs(b, "inc", 3100)
    # 4 runs in a row, then gaps of 2, 4, 8, ... and 1024 from there on
    assert got == [1, 2, 3, 4, 6, 10, 18, 34, 66, 130, 258, 514, 1026, 2050, 3074]
    assert max(b - a for a, b in zip(got, got[1:], strict=False)) == MAX_GAP
    assert b.gap("inc") == MAX_GAP and b.gap("other") == 1


def test_a_run_leaving_something_is_found_within_the_gap_and_resets_it() -> None:
    b = Backoff(clock=Runs())
    got = measured_runs(b, "inc", 200, left_at=frozenset({40}))
    # the leaking run 40 falls in the stretch 35..66: found by run 66, 26 runs later,
    # then every run measured until 4 quiet ones, and backing off again
    assert [r for r in got if 34 <= r <= 90] == [34, 66, 67, 68, 69, 70, 72, 76, 84]
    # wherever it falls, found at most MAX_GAP - 1 runs later (2050 to 3073: 1023 later)
    for leak in [*range(35, 300), *range(300, 3074, 7), 2051, 3073]:
        c = Backoff(clock=Runs())
        found = [r for r in measured_runs(c, "x", 3100, frozenset({leak})) if r >= leak][0]
        assert found - leak <= MAX_GAP - 1


def test_runs_longer_than_the_wait_are_each_measured() -> None:
    # a run a third of a second after the last: past MAX_WAIT, measured, quiet or not
    b = Backoff(clock=(clock := Runs(seconds=1 / 3)))
    assert measured_runs(b, "fit", 50, clock=clock) == list(range(1, 51))
    assert b.gap("fit") == MAX_GAP  # the run count alone would leave 1023 in 1024 unmeasured


def test_the_wait_bounds_the_gap_of_runs_a_thirty_second_of_a_second_long() -> None:
    # 8 runs make MAX_WAIT: gaps of 2, 4 and 8 by the count, then 8 by the clock (the
    # count's 16 and on come too late); a leak is found at most 8 runs later
    b = Backoff(clock=(clock := Runs(seconds=1 / 32)))
    got = measured_runs(b, "mid", 100, clock=clock)
    assert got[:9] == [1, 2, 3, 4, 6, 10, 18, 26, 34]
    assert {b - a for a, b in zip(got[6:], got[7:], strict=False)} == {8}
    for leak in range(19, 90):
        c = Backoff(clock=(clock := Runs(seconds=1 / 32)))
        found = [r for r in measured_runs(c, "x", 100, frozenset({leak}), clock) if r >= leak]
        assert found[0] - leak <= 7


def test_a_run_the_clock_made_due_stays_due_until_measured() -> None:
    # backed off to a gap of 128 (run 130 measured), then a quarter of a second passes: the
    # run that starts then is due; it could not be measured (not alone on its devices),
    # so the next run is due too, and the one after it once that one is measured
    b = Backoff(clock=(clock := Runs()))
    assert measured_runs(b, "p", 130)[-1] == 130 and b.gap("p") == 128
    clock.seconds = MAX_WAIT
    clock.run = 1
    assert b.measure("p")  # no measured() follows
    assert b.measure("p")
    b.measured("p", False)
    clock.seconds = 0.0
    assert not b.measure("p")


def test_prefixes_back_off_apart_and_reset_is_every_run() -> None:
    b = Backoff(quiet=1, max_gap=4, clock=Runs())
    assert measured_runs(b, "a", 12) == [1, 3, 7, 11]
    assert measured_runs(b, "b", 3) == [1, 3] and b.gap("a") == 4  # each its own
    b.reset("a")
    assert b.measure("a") and b.gap("a") == 1


def test_one_quiet_streak_is_needed_in_a_row() -> None:
    b = Backoff()
    for left in (False, False, False, True, False, False, False):
        assert b.measure("p")
        b.measured("p", left)
    assert b.gap("p") == 1 and b.measure("p")  # 3 quiet since the reset: not yet sampled


def test_bounded_record_and_validated_numbers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(leak_policy, "MAX_PREFIXES", 3)
    b = Backoff(quiet=1)
    for p in "abcd":
        b.measured(p, False)
    assert b.gap("d") == 2 and b.gap("a") == 1  # the record started over at the 4th
    with pytest.raises(ValueError, match="at least 1"):
        Backoff(quiet=0)
    with pytest.raises(ValueError, match="at least 1"):
        Backoff(max_gap=0)
    for wait in (0, -1.0, math.nan):
        with pytest.raises(ValueError, match=f"max_wait above 0, not 4, 1024, {wait}"):
            Backoff(max_wait=wait)
    assert Backoff(max_wait=math.inf).max_wait == math.inf  # the run count's rule alone
