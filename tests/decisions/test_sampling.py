"""Which runs of a task prefix the ledger measures on a device with a context
(:class:`accelsched.policy.leak.Backoff`), with numbers: every run until runs keep
leaving nothing, then a sample backing off to one run in :data:`MAX_GAP`; the first run
found leaving something puts the prefix back to every run."""

from __future__ import annotations

import pytest

from accelsched.policy import leak as leak_policy
from accelsched.policy.leak import MAX_GAP, QUIET_RUNS, Backoff


def measured_runs(
    b: Backoff, prefix: str, runs: int, left_at: frozenset[int] = frozenset()
) -> list[int]:
    """The runs (1-based) ``b`` measures; a measured run numbered in ``left_at``, or one
    measured after an unmeasured run so numbered, finds something left behind."""
    out, pending = [], False
    for run in range(1, runs + 1):
        pending = pending or run in left_at
        if b.measure(prefix):
            out.append(run)
            b.measured(prefix, pending)
            pending = False
    return out


def test_every_run_until_quiet_then_doubling_gaps_up_to_the_bound() -> None:
    assert (QUIET_RUNS, MAX_GAP) == (4, 16)
    b = Backoff()
    got = measured_runs(b, "inc", 130)
    # 4 runs in a row, then gaps of 2, 4, 8 and 16 from there on
    assert got == [1, 2, 3, 4, 6, 10, 18, 34, 50, 66, 82, 98, 114, 130]
    assert max(b - a for a, b in zip(got, got[1:], strict=False)) == MAX_GAP
    assert b.gap("inc") == MAX_GAP and b.gap("other") == 1


def test_a_run_leaving_something_is_found_within_the_gap_and_resets_it() -> None:
    b = Backoff()
    got = measured_runs(b, "inc", 200, left_at=frozenset({40}))
    # the leaking run 40 falls in the stretch 35..50: found by run 50, 10 runs later,
    # then every run measured until 4 quiet ones, and backing off again
    assert [r for r in got if 34 <= r <= 70] == [34, 50, 51, 52, 53, 54, 56, 60, 68]
    for leak in range(35, 120):  # wherever it falls, found at most MAX_GAP - 1 runs later
        c = Backoff()
        found = [r for r in measured_runs(c, "x", 200, frozenset({leak})) if r >= leak][0]
        assert found - leak <= MAX_GAP - 1


def test_prefixes_back_off_apart_and_reset_is_every_run() -> None:
    b = Backoff(quiet=1, max_gap=4)
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
