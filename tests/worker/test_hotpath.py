"""The GPU task's hot path reads NVML only when a reading can serve: a device without a
context gives no base to measure by, so tasks there are not read around, yet the first
task after one makes a context is measured as before (its unknown result held, not
leaked). The real binder and ledger on the fake GPUs, in this process, task by task."""

from __future__ import annotations

from typing import Any

import pytest
from dask._task_spec import Task

from accelsched.devices.nvml import MemoryReading, NVMLMonitor
from accelsched.policy.leak import Attribution
from accelsched.testing import create_context, device_alloc
from accelsched.worker.binder import Binder
from accelsched.worker.ledger import LEARN, MEASURE, SKIP, Ledger
from accelsched.worker.pool_freer import PoolFreer
from tests.utils import MiB, inc, marked_warm_up, warm_up

pytestmark = pytest.mark.usefixtures("fake_gpus_2")


class Counting(NVMLMonitor):
    """The real monitor, counting this process's per-process reads; ``race`` runs
    (once each) just after a reading, as a leak check on the event loop may."""

    reads = 0

    def __init__(self) -> None:
        super().__init__()
        self.race: list[Any] = []

    def process_memory(self, device: int) -> MemoryReading:
        self.reads += 1
        reading = super().process_memory(device)
        while self.race:
            self.race.pop()()
        return reading


class Frame:
    """A result of a type nothing describes (a cudf frame, say)."""

    def __init__(self, nbytes: int) -> None:
        self.payload = device_alloc(nbytes)


def make_frame(nbytes: int) -> Frame:
    return Frame(nbytes)


class Tasks:
    """Runs tasks through the guard's binder, one at a time, as a one-GPU worker does."""

    def __init__(self) -> None:
        self.monitor = Counting()
        self.residues: list[tuple[str, dict[int, int]]] = []
        self.attribution = Attribution()  # runs seen to leave nothing, by prefix
        self.results: dict[str, Any] = {}  # the worker's memory
        self.ledger = Ledger(
            self.monitor,
            residue=lambda name, left: self.residues.append((name, left)),
            left_nothing=self.attribution.left_nothing,
            stored=self.results.get,
        )
        self.binder = Binder(
            oom_exceptions=(),
            pools=PoolFreer(every=1, above=0.0, monitor=self.monitor),
            emit=lambda *a, **k: None,
            ledger=self.ledger,
        )
        self.binder.set_devices([0])
        self.n = 0

    def blamed(self, runs: dict[str, int]) -> tuple[str, ...]:
        """The prefixes of ``runs`` a leak would blame: not those seen to leave nothing."""
        return self.attribution.suspects([0], runs, clear=False)[0].blamed

    def run(self, func: Any, *args: Any) -> tuple[str, Any]:
        self.n += 1
        prefix = func.__name__
        key = f"{prefix}-{self.n}"
        runner = self.binder.gpu_runner(key, 1, prefix)
        result = self.results[key] = runner(Task(key, func, *args), {})
        return key, result


def test_no_context_no_reads_after_the_first_runs_of_a_prefix() -> None:
    tasks = Tasks()
    for i in range(50):
        tasks.run(inc, i)
    # the first run's base (no context) and the next one's closing reading (still none:
    # inc makes no context); then nothing until a check
    assert tasks.monitor.reads == 2
    assert tasks.ledger.plan((0,), "inc") == SKIP
    assert tasks.ledger.plan((0,), "other") == LEARN
    tasks.ledger.recheck()  # a leak check: read again before the next task
    assert tasks.ledger.plan((0,), "inc") == MEASURE
    for i in range(10):
        tasks.run(inc, i)
    assert tasks.monitor.reads == 3


def test_a_check_during_a_runs_readings_does_not_hide_that_it_left_nothing() -> None:
    """A leak check's ``recheck`` landing while a run's reading is taken drops the "no
    context" the reading would record; the run's own readings still found none before
    and after it, so it is seen to leave nothing (leak attribution never names it)."""
    tasks = Tasks()
    tasks.monitor.race.append(tasks.ledger.recheck)  # during inc's base reading
    tasks.run(inc, 1)
    assert tasks.monitor.reads == 2  # the base, and a closing reading to learn by
    assert tasks.blamed({"inc": 1}) == ()  # every run left nothing: innocent

    def keep(i: int) -> int:  # a prefix not seen yet: planned LEARN
        return i

    assert tasks.ledger.plan((0,), "keep") == LEARN
    tasks.monitor.race.append(tasks.ledger.recheck)  # during keep's closing reading
    tasks.run(keep, 1)
    assert tasks.blamed({"inc": 1, "keep": 1}) == ()
    assert tasks.ledger.plan((0,), "keep") == MEASURE  # not learnt: the check dropped it
    tasks.run(keep, 2)  # read again: no context, learnt now
    assert tasks.blamed({"keep": 2}) == ()
    assert tasks.ledger.plan((0,), "keep") == SKIP


@pytest.mark.parametrize("first", [warm_up, marked_warm_up], ids=["plain", "marked step"])
def test_the_task_after_a_context_is_made_is_measured(first: Any) -> None:
    tasks = Tasks()
    tasks.run(inc, 1)  # no context: nothing measured, "no context" known
    tasks.run(first)  # makes the context (in a marked step, or in the task itself)
    key, frame = tasks.run(make_frame, 256 * MiB)
    assert tasks.ledger.entered(key, computed=True) == {0: 256 * MiB}


def test_a_known_prefix_that_makes_a_context_is_caught_by_its_pool() -> None:
    tasks = Tasks()
    for i in range(5):
        tasks.run(inc, i)
    assert tasks.ledger.plan((0,), "inc") == SKIP

    def inc_on_gpu(i: int) -> int:  # same prefix as inc: runs of it were seen clean
        device_alloc(MiB)
        return i + 1

    inc_on_gpu.__name__ = "inc"
    tasks.run(inc_on_gpu, 1)  # not read around; its pool now holds memory
    key, frame = tasks.run(make_frame, 128 * MiB)
    assert tasks.ledger.entered(key, computed=True) == {0: 128 * MiB}


def test_a_context_no_pool_tells_of_waits_for_the_next_check() -> None:
    """A context made without pool memory by a prefix seen clean is noticed at the next
    leak check (the guard's ``check`` calls ``recheck``); until then tasks there are not
    measured: what they hold without a pool is folded into the baseline, as memory
    allocated before a device's first check always was (docs/guards.md)."""
    tasks = Tasks()
    for i in range(3):
        tasks.run(inc, i)

    def inc_context(i: int) -> int:
        create_context()
        return i

    inc_context.__name__ = "inc"
    tasks.run(inc_context, 1)
    assert tasks.ledger.plan((0,), "inc") == SKIP
    tasks.ledger.recheck()
    tasks.run(inc, 1)
    key, frame = tasks.run(make_frame, 64 * MiB)
    assert tasks.ledger.entered(key, computed=True) == {0: 64 * MiB}


def test_a_result_holding_nothing_leaves_no_live_entry() -> None:
    tasks = Tasks()
    tasks.run(warm_up)
    key, value = tasks.run(inc, 1)  # measured (a context exists): grew by nothing
    assert key in tasks.ledger._measured
    assert tasks.ledger.entered(key, computed=True) == {}
    assert key not in tasks.ledger._measured and key not in tasks.ledger._held
    assert tasks.ledger.live(0) == 0
    assert Ledger.holds_nothing(3) and Ledger.holds_nothing("x")
    assert not Ledger.holds_nothing(Frame.__new__(Frame))


def test_a_bound_task_keeps_its_key_and_dependencies_and_runs_through_the_runner() -> None:
    from dask._task_spec import TaskRef

    from accelsched.internals import wrap_task
    from accelsched.internals.worker import _is_coro

    spec = Task("inc-2", inc, TaskRef("inc-1"))
    seen: list = []

    def runner(s: Any, values: Any) -> Any:
        seen.append((s, values))
        return s(values)

    bound = wrap_task(spec, runner)
    assert wrap_task(bound, runner) is bound  # wrapping twice is a no-op
    assert bound.key == "inc-2" and bound.dependencies == frozenset({"inc-1"})
    assert not bound.is_coro and repr(bound) == repr(spec)
    assert bound({"inc-1": 41}) == 42 and seen == [(spec, {"inc-1": 41})]

    async def coro() -> int:
        return 1

    class Unhashable:
        __hash__ = None  # type: ignore[assignment]

        def __call__(self) -> int:
            return 1

    assert _is_coro(Task("c-1", coro)) and _is_coro(Task("c-2", coro))  # known per function
    assert not _is_coro(Task("u-1", Unhashable())) and not _is_coro(spec)
