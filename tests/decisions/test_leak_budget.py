"""The leak decisions and the restart budget, decided with numbers and no cluster."""

from __future__ import annotations

import pytest

from accelsched.config import PLACEMENT_OPTIONS, resolve_options
from accelsched.devices import PoolStats
from accelsched.policy.leak import Attribution, DeviceRecord, LeakDecisions, Verdict, estimate
from accelsched.policy.requests import RestartBudget
from tests.utils import GiB, MiB


def test_estimate_nets_out_live_results_and_caches() -> None:
    # context 300 MiB, 2 GiB of results held, 1 GiB cached by the pool: no leak
    pool = PoolStats(held=3 * GiB, cached=GiB)
    assert estimate(300 * MiB + 3 * GiB, 300 * MiB, 2 * GiB, pool) == 0
    # the same plus 512 MiB referenced by nothing the worker knows about
    assert estimate(300 * MiB + 3 * GiB + 512 * MiB, 300 * MiB, 2 * GiB, pool) == 512 * MiB


def test_estimate_fixed_pool_is_retained_not_leaked() -> None:
    # RMM-style 8 GiB pool that cannot say what is free; results live inside it
    pool = PoolStats(held=8 * GiB, fixed=8 * GiB, fixed_free=None)
    for live in (0, GiB, 8 * GiB):
        assert estimate(300 * MiB + 8 * GiB, 300 * MiB, live, pool) <= 0
    # memory allocated outside the pool is still seen
    assert estimate(300 * MiB + 9 * GiB, 300 * MiB, GiB, pool) == GiB
    # a pool that knows its free part: results held outside it are not double counted
    known = PoolStats(held=10 * GiB, fixed=8 * GiB, fixed_free=7 * GiB)  # 2 GiB CuPy pool beside
    assert estimate(300 * MiB + 10 * GiB, 300 * MiB, 3 * GiB, known) == 0
    assert estimate(300 * MiB + 10 * GiB, 300 * MiB, 2 * GiB, known) == GiB


def test_baseline_takes_the_smallest_footprint() -> None:
    b = DeviceRecord()
    assert b.observe_baseline(process=500 * MiB, live=0, pool_held=200 * MiB) == 300 * MiB
    # results allocated from the pool are inside pool_held: not subtracted twice
    assert b.observe_baseline(process=1300 * MiB, live=1000 * MiB, pool_held=1000 * MiB) == (
        300 * MiB
    )
    # results from an allocator no pool reports
    assert DeviceRecord().observe_baseline(process=1300 * MiB, live=1000 * MiB, pool_held=0) == (
        300 * MiB
    )
    assert b.observe_baseline(process=450 * MiB, live=0, pool_held=200 * MiB) == 250 * MiB
    assert DeviceRecord().observe_baseline(process=10, live=50, pool_held=0) == 0


def judged(d: LeakDecisions, device: int, estimate: int, threshold: int) -> Verdict:
    """One check of ``device`` alone."""
    (verdict,) = d.count({device: (estimate, threshold)})
    return verdict


def blamed(d: LeakDecisions, estimates: dict[int, int], *, complete: bool = True) -> list[str]:
    """The prefixes one check at ``estimates`` (threshold 10) blames, by name."""
    suspects = d.suspects(
        d.count({dev: (n, 10) for dev, n in estimates.items()}), complete=complete
    )
    return [p for s in suspects.values() for p in s.blamed]


def test_leak_needs_consecutive_confirmations() -> None:
    d = LeakDecisions(confirmations=3)
    t = GiB
    assert [judged(d, 0, 2 * t, t).leak for _ in range(2)] == [False, False]
    assert judged(d, 0, 0, t).above == 0  # a dip resets the count
    verdicts = [judged(d, 0, 2 * t, t) for _ in range(3)]
    assert [v.above for v in verdicts] == [1, 2, 3]
    assert [v.leak for v in verdicts] == [False, False, True]
    assert judged(d, 1, 2 * t, t).above == 1  # devices are counted apart


def test_big_leak_acted_on_at_first_check_with_one_confirmation() -> None:
    d = LeakDecisions(confirmations=1)
    assert judged(d, 0, GiB + 1, GiB).leak
    assert not judged(d, 0, GiB, GiB).leak  # at the threshold is not above it


def test_prefixes_since_last_clean_check() -> None:
    d = LeakDecisions(confirmations=1, restart_on_leak=False)
    d.ran("load")
    assert blamed(d, {0: 0}) == ["load"]
    d.ran("leaky")
    assert blamed(d, {0: 20}) == ["leaky"]  # not clean: kept
    d.ran("after")
    assert blamed(d, {0: 20}) == ["after", "leaky"]
    d.devices[0].tried(before=20, after=20, threshold=10)  # tried already: held
    (leak,) = d.propose(d.count({0: (20, 10)}), complete=True)
    assert leak.figures["checks"] == 3
    assert judged(d, 0, 20, 10).above == 1  # a leak acted on: every count starts again
    d.ran("busy")
    assert blamed(d, {0: 0}, complete=False) == ["after", "busy", "leaky"]  # not clean
    assert blamed(d, {0: 0}) == ["after", "busy", "leaky"]
    assert blamed(d, {0: 0}) == []


def test_runs_per_prefix_since_last_clean_check() -> None:
    d = LeakDecisions(confirmations=2)
    for prefix in ("load", "load", "leaky"):
        d.ran(prefix)
    d.attribution.left_nothing("load")  # one of its two runs
    assert blamed(d, {0: 20}) == ["leaky", "load"]  # counted per run
    d.attribution.left_nothing("load")
    assert blamed(d, {0: 20}) == ["leaky"]  # not clean: kept, and both runs left nothing
    assert blamed(d, {0: 0}) == ["leaky"]
    assert blamed(d, {0: 0}) == []


def test_innocent_prefixes_are_those_every_run_of_which_left_nothing() -> None:
    a = Attribution()
    a.left_nothing("keep")
    a.left_nothing("keep")
    a.left_nothing("half")
    (suspects,) = a.suspects([0], {"keep": 2, "half": 2, "leaky": 1}, clear=True).values()
    assert suspects.blamed == ("half", "leaky")  # "keep" alone innocent
    (suspects,) = a.suspects([0], {"keep": 2}, clear=False).values()
    assert suspects.blamed == ("keep",)  # forgotten


def test_a_stretch_of_runs_that_left_nothing_counts_each_run() -> None:
    """A measured run that grew by nothing clears the unmeasured runs it read across
    with it, in one call: ``keep`` ran 5 times and is innocent, ``half`` ran 5 times
    and only 4 are cleared."""
    a = Attribution()
    a.left_nothing("keep", 4)
    a.left_nothing("keep", 1)
    a.left_nothing("half", 4)
    (suspects,) = a.suspects([0], {"keep": 5, "half": 5}, clear=True).values()
    assert suspects.blamed == ("half",)


def test_decisions_reject_zero_confirmations() -> None:
    with pytest.raises(ValueError, match="confirmations=0"):
        LeakDecisions(confirmations=0)


def test_budget_per_worker_window() -> None:
    b = RestartBudget(max_restarts=2, window=60.0, max_concurrent=5)
    assert b.request("w", 0.0) is None
    b.done("w")
    assert b.request("w", 10.0) is None
    b.done("w")
    refused = b.request("w", 20.0)
    assert refused == "budget"
    assert b.request("w", 60.5) is None  # the first restart left the window
    assert b.request("other", 61.0) is None


def test_budget_concurrency_and_uncounted() -> None:
    b = RestartBudget(max_restarts=3, window=60.0, max_concurrent=1)
    assert b.request("a", 0.0) is None
    assert b.request("a", 0.1) == "in-flight"
    assert b.request("b", 0.1) == "concurrency"
    b.done("a", counted=False)  # the restart did not happen: it does not count
    assert b.request("b", 0.2) is None
    assert b.in_flight == {"b"}
    b.done("b")
    for now in (0.3, 0.4, 0.5):  # a has counted none: all 3 of its budget are left
        assert b.request("a", now) is None
        b.done("a")
    assert b.request("a", 0.6) == "budget"


def test_budget_validates() -> None:
    # the budget's figures are the plugin's options, validated where they are read
    with pytest.raises(ValueError, match="max_concurrent_restarts=0"):
        resolve_options(PLACEMENT_OPTIONS, {"max_concurrent_restarts": 0}, "PlacementPlugin")


def test_budget_forgets_workers_outside_the_window() -> None:
    b = RestartBudget(max_restarts=1, window=10.0, max_concurrent=5)
    for i in range(50):
        assert b.request(f"w{i}", float(i)) is None
        b.done(f"w{i}")
    assert b.request("last", 100.0) is None
    assert set(b._history) == {"last"}
