"""The GPU task's hot path reads NVML only when a reading can serve: a device without a
context gives no base to measure by, so tasks there are not read around, yet the first
task after one makes a context is measured as before (its unknown result held, not
leaked). The real binder and ledger on the fake GPUs, in this process, task by task."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from dask._task_spec import Task

from accelsched.devices import MemoryReading, NVMLMonitor
from accelsched.policy.leak import MAX_GAP, MAX_WAIT, Attribution, Backoff
from accelsched.testing import create_context, device_alloc
from accelsched.worker.guard_plugin import Binder, PoolFreer
from accelsched.worker.leak_check import LEARN, MEASURE, SKIP, Ledger
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
    """Runs tasks through the guard's binder, one at a time, as a one-GPU worker does.
    ``clock``: the sampler's; time stands still by default, so which runs are read is the
    run count's rule alone (its clock's rule: ``test_sampling.py``, and the long runs
    below)."""

    def __init__(
        self, clock: Callable[[], float] = lambda: 0.0, devices: tuple[int, ...] = (0,)
    ) -> None:
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
        self.ledger.sampler = Backoff(clock=clock)
        self.binder = Binder(
            oom_exceptions=(),
            pools=PoolFreer(every=1, above=0.0, monitor=self.monitor),
            emit=lambda *a, **k: None,
            ledger=self.ledger,
        )
        self.binder.set_devices(list(devices))
        self.n = 0

    def gap(self, prefix: str, device: int = 0) -> int:
        """Runs from one measured run of ``prefix`` on ``device`` to the next, now."""
        return self.ledger.sampler.gap((prefix, (device,)))

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


def test_the_hot_paths_lease_is_the_public_one() -> None:
    """The guard makes each task's lease without the frozen dataclass's ``__init__``: the
    very object ``Lease(...)`` makes, every field set (a field added to ``Lease`` and not
    to ``lease_of`` fails here), frozen all the same."""
    import dataclasses

    from accelsched.context import Lease, lease_of
    from accelsched.devices import MemoryCap

    fields = {
        "key": ("inc", 1),
        "devices": (0, 1),
        "report": print,
        "oom_exceptions": ("cupy.cuda.memory.OutOfMemoryError",),
        "meter": len,
        "cap": MemoryCap("inc-1", MiB, enforce=True),
        "cuda": object(),
    }
    assert [f.name for f in dataclasses.fields(Lease)] == list(fields)
    assert not hasattr(Lease, "__post_init__")  # lease_of would skip what it checks
    made, public = lease_of(*fields.values()), Lease(**fields)  # type: ignore[arg-type]
    assert type(made) is Lease and made == public and hash(made) == hash(public)
    assert vars(made) == vars(public) and repr(made) == repr(public)
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.key = "other"  # type: ignore[misc]


# --- on a device with a context: a sample of a quiet prefix's runs is measured ----------


def quiet_inc(tasks: Tasks, runs: int) -> None:
    """``runs`` tiny tasks of prefix ``inc`` after a context was made: backed off."""
    tasks.run(warm_up)
    for i in range(runs):
        tasks.run(inc, i)


def test_tiny_tasks_on_a_context_are_read_on_a_sample_and_left_nothing_counted() -> None:
    tasks = Tasks()
    quiet_inc(tasks, 2100)
    # was one closing reading a task (2101): now the warm-up's two, inc's first run's base
    # and closing reading, its next 3 runs, then one run in 2, 4, 8, ... and 1024 from
    # there on (runs 6, 10, 18, 34, 66, 130, 258, 514, 1026 and 2050)
    assert MAX_GAP == 1024 and tasks.monitor.reads == 2 + 2 + 3 + 10
    assert tasks.gap("inc") == MAX_GAP
    assert not [r for r in tasks.residues if any(r[1].values())]
    # every run a measured stretch closed is seen to leave nothing; the open stretch's
    # runs (2051 on), not yet: they stay suspects of a leak until their prefix is read again
    nothing = tasks.attribution._nothing["inc"]
    assert nothing == 2050
    assert tasks.blamed({"inc": nothing}) == ()


def test_a_quiet_prefix_whose_runs_outlast_the_wait_is_read_at_every_run() -> None:
    """Beside a run longer than MAX_WAIT a reading costs next to nothing: no run of such
    a prefix is left unmeasured, and a leak is attributed to the run that left it."""
    now = [0.0]
    tasks = Tasks(clock=lambda: now[0])

    def slow(i: int) -> int:  # a run of a third of a second, on the sampler's clock
        now[0] += 1 / 3
        return i + 1

    tasks.run(warm_up)
    tasks.run(slow, 0)  # a new prefix: a base reading of its own, and its closing one
    for i in range(20):
        reads = tasks.monitor.reads
        tasks.run(slow, i)
        assert tasks.monitor.reads == reads + 1, f"run {i} was not measured"
    assert tasks.gap("slow") == MAX_GAP  # the count alone: 1 run in 1024
    assert MAX_WAIT < 1 / 3  # each run outlasts the wait

    def slow_leaky(i: int) -> int:
        device_alloc(64 * MiB, leak=True)
        return slow(i)

    slow_leaky.__name__ = "slow"
    tasks.run(slow_leaky, 1)
    assert [r for r in tasks.residues if r[1].get(0)] == [("slow", {0: 64 * MiB})]


def test_a_prefix_alternating_devices_is_sampled_on_each() -> None:
    """A stretch of unmeasured runs is a device's: runs of one prefix alternating between
    two devices are sampled on each, so a leak on either is attributed within the gap of
    that device's runs. (Sampled by prefix alone, every measured run from the 4th on,
    2 to 128 runs apart, fell on the device of the even runs: a leak on the other was
    found by no run.)"""
    tasks = Tasks(devices=(0, 1))
    leases = tasks.binder.leases

    def on(device: int, func: Any, *args: Any) -> None:
        if device == 1:  # the binder leases the lowest idle device: device 0 held meanwhile
            assert leases.grant("hold-0", 1) == (0,)
        try:
            tasks.run(func, *args)
        finally:
            if device == 1:
                leases.release("hold-0")

    on(0, warm_up)
    on(1, warm_up)  # a context on both devices: runs on either are measured or sampled
    for i in range(300):  # run i + 1 on device 0 when odd, on device 1 when even
        on(i % 2, inc, i)
    assert tasks.gap("inc", 0) == 128 == tasks.gap("inc", 1)  # 150 runs each: backed off

    def inc_leaky(i: int) -> int:
        device_alloc(64 * MiB, leak=True)
        return i + 1

    inc_leaky.__name__ = "inc"
    gap = tasks.gap("inc", 0)
    on(0, inc_leaky, 1)
    runs_on_0 = 0
    while not [r for r in tasks.residues if r[1].get(0)]:
        on(1, inc, 0)
        runs_on_0 += 1
        assert runs_on_0 < gap, "the leak on device 0 was not attributed within its gap"
        on(0, inc, runs_on_0)
    assert [r for r in tasks.residues if r[1].get(0)] == [("inc", {0: 64 * MiB})]
    assert tasks.gap("inc", 0) == 1 and tasks.gap("inc", 1) == 128


def test_a_leak_in_an_unmeasured_run_is_attributed_within_the_gap() -> None:
    tasks = Tasks()
    quiet_inc(tasks, 100)

    def inc_leaky(i: int) -> int:  # the same prefix: its runs were seen to leave nothing
        device_alloc(64 * MiB, leak=True)
        return i + 1

    inc_leaky.__name__ = "inc"
    gap = tasks.gap("inc")
    assert gap == 64  # backed off (run 66 the last measured), of MAX_GAP at most
    tasks.run(inc_leaky, 1)
    runs = 0
    while not [r for r in tasks.residues if r[1].get(0)]:
        runs += 1
        assert runs < gap, "the leak was not attributed within the gap"
        tasks.run(inc, runs)
    assert [r for r in tasks.residues if r[1].get(0)] == [("inc", {0: 64 * MiB})]
    assert tasks.gap("inc") == 1  # every run measured again
    reads = tasks.monitor.reads
    tasks.run(inc, 0)
    assert tasks.monitor.reads == reads + 1


def test_another_prefixs_run_ends_a_stretch_unmeasured_never_blaming_itself() -> None:
    """A leak in an unmeasured run followed by another prefix's task: that task reads a
    base of its own (the stretch is not its to measure); the leaking prefix's unmeasured
    runs are not counted as leaving nothing, so a leak found by the check names it."""
    tasks = Tasks()
    quiet_inc(tasks, 100)
    while tasks.ledger._fresh.get(0, [0, None])[1] is None:  # to an unmeasured stretch
        tasks.run(inc, 0)
    unmeasured = tasks.ledger._fresh[0][2]

    def inc_leaky(i: int) -> int:
        device_alloc(64 * MiB, leak=True)
        return i + 1

    inc_leaky.__name__ = "inc"
    tasks.run(inc_leaky, 1)
    assert tasks.ledger._fresh[0][2] == unmeasured + 1  # unmeasured, in inc's stretch

    def other(i: int) -> int:
        return i

    tasks.run(other, 1)  # measured (a new prefix), from a base read now
    assert not [r for r in tasks.residues if r[1].get(0)]
    assert tasks.blamed({"inc": tasks.n - 2, "other": 1}) == ("inc",)


def test_a_result_of_unknown_type_in_an_unmeasured_run_is_measured() -> None:
    tasks = Tasks()
    quiet_inc(tasks, 100)

    def inc_frame(i: int) -> Frame:  # the same prefix, a result nothing describes
        return Frame(128 * MiB)

    inc_frame.__name__ = "inc"
    assert tasks.gap("inc") == 64  # backed off: run 66 the last measured
    for i in range(3):  # wherever in the stretch: held at its growth, not leaked
        key, frame = tasks.run(inc_frame, i)
        assert tasks.ledger.entered(key, computed=True) == {0: 128 * MiB}
    assert tasks.ledger.live(0) == 3 * 128 * MiB
    assert not [r for r in tasks.residues if r[1].get(0)]


def test_an_unmeasured_runs_reading_spoiled_by_an_arrival_measures_its_prefix_again() -> None:
    """A result nothing describes, from a backed-off prefix, is measured from before its
    stretch; when data from a peer lands on the device as that reading is taken, the
    reading cannot say what the result holds, so every run of the prefix is measured
    again, as when its stretch broke (before: left backed off, its next opaque results
    read only at the gap's next run)."""
    tasks = Tasks()
    quiet_inc(tasks, 100)
    assert tasks.gap("inc") == 64

    def inc_frame(i: int) -> Frame:  # the same prefix, a result nothing describes
        return Frame(MiB)

    inc_frame.__name__ = "inc"

    def arrival() -> None:  # a peer's frame entering the worker's memory meanwhile
        tasks.results["from-a-peer"] = Frame(MiB)
        tasks.ledger.entered("from-a-peer", computed=False)

    tasks.monitor.race.append(arrival)  # runs just after the closing reading
    tasks.run(inc_frame, 0)
    assert not tasks.monitor.race  # the reading was taken, the arrival came with it
    assert tasks.gap("inc") == 1  # measured again, run by run


def test_known_device_results_of_a_stretch_are_not_taken_for_residue() -> None:
    """Results of a known type holding device memory (arrays a rule describes), kept in
    memory, in unmeasured runs: held by type, and the stretch's next reading takes them
    off its growth, so no residue is found where none was left."""
    tasks = Tasks()
    tasks.run(warm_up)

    def keep(i: int) -> Any:
        return device_alloc(MiB)

    for i in range(70):  # backed off to a gap of 64 from run 66 on
        key, _ = tasks.run(keep, i)
        assert tasks.ledger.entered(key, computed=True) == {0: MiB}
    assert tasks.gap("keep") == 64
    assert tasks.monitor.reads < 20
    assert not [r for r in tasks.residues if any(r[1].values())]
    assert tasks.ledger.live(0) == 70 * MiB


def leaks_and_fails(i: int) -> int:
    """Leaves 64 MiB behind on its device, then raises."""
    device_alloc(64 * MiB, leak=True)
    raise ValueError("boom")


def to_a_stretch(tasks: Tasks) -> None:
    """Run ``inc`` until its next run is left unmeasured (a quiet prefix, mid-stretch)."""
    while tasks.ledger._fresh.get(0, [0, None, 0])[2] < 1:
        tasks.run(inc, 0)
    assert tasks.gap("inc") >= 4


def test_a_task_beside_an_unmeasured_run_ends_its_stretch() -> None:
    """Another prefix's task shares the device with an unmeasured run of ``inc`` and
    leaks meanwhile: the stretch ends with it, so ``inc``'s next measured run reads a
    base of its own and is not blamed for what the other left (no run of a stretch
    proves it ran alone: each ends by joining its stretch or ending it)."""
    tasks = Tasks()
    quiet_inc(tasks, 100)
    to_a_stretch(tasks)

    def leaky(i: int) -> int:
        device_alloc(64 * MiB, leak=True)
        return i

    def inc_beside(i: int) -> int:  # while it runs, another task takes half its device
        return tasks.binder.gpu_runner("leaky-1", 0.5, "leaky")(Task("leaky-1", leaky, i), {})

    inc_beside.__name__ = "inc"
    reads = tasks.monitor.reads
    tasks.binder.gpu_runner("inc-beside", 0.5, "inc")(Task("inc-beside", inc_beside, 1), {})
    assert tasks.monitor.reads == reads  # neither was read: inc's run was unmeasured
    assert 0 not in tasks.ledger._fresh  # and its stretch ended
    for i in range(MAX_GAP):
        tasks.run(inc, i)
    assert not [r for r in tasks.residues if r[1].get(0)]


def test_a_failed_unmeasured_run_stays_in_its_prefixs_stretch() -> None:
    """An unmeasured run that leaks and raises is one of its stretch's runs: the
    stretch's next reading attributes what it left to its prefix."""
    tasks = Tasks()
    quiet_inc(tasks, 100)
    to_a_stretch(tasks)

    def inc_failing(i: int) -> int:
        return leaks_and_fails(i)

    inc_failing.__name__ = "inc"
    reads, runs = tasks.monitor.reads, tasks.ledger._fresh[0][2]
    with pytest.raises(ValueError, match="boom"):
        tasks.run(inc_failing, 1)
    assert tasks.monitor.reads == reads and tasks.ledger._fresh[0][2] == runs + 1
    for i in range(MAX_GAP):
        tasks.run(inc, i)
    assert [r for r in tasks.residues if r[1].get(0)] == [("inc", {0: 64 * MiB})]


def test_a_failing_measured_task_beside_an_unmeasured_run_ends_its_stretch() -> None:
    """A measured task of another prefix (not alone: no base) shares the device with an
    unmeasured run of ``inc``, leaks and raises: the stretch ends with it, so what it
    left is not blamed on ``inc``."""
    tasks = Tasks()
    quiet_inc(tasks, 100)
    to_a_stretch(tasks)

    def inc_beside(i: int) -> int:  # while it runs, a failing task takes half its device
        with pytest.raises(ValueError, match="boom"):
            failing = tasks.binder.gpu_runner("failing-1", 0.5, "failing")
            failing(Task("failing-1", leaks_and_fails, i), {})
        return i + 1

    inc_beside.__name__ = "inc"
    tasks.binder.gpu_runner("inc-beside", 0.5, "inc")(Task("inc-beside", inc_beside, 1), {})
    for i in range(MAX_GAP):
        tasks.run(inc, i)
    assert not [r for r in tasks.residues if r[1].get(0)]


def test_a_task_leasing_beside_a_closing_reading_leaves_no_base() -> None:
    """A measured task found alone when its function returned, and another task packs
    beside it before its closing reading, holding 64 MiB for a moment: that reading is
    not a base for later runs, so ``inc``'s leaks after it are still found."""
    import threading

    tasks = Tasks()
    quiet_inc(tasks, 100)
    leases, read, done = tasks.binder.leases, threading.Event(), threading.Event()
    original = leases.still_alone

    def beside() -> None:  # an unmeasured run of inc, with a 64 MiB temporary
        def temporary(i: int) -> int:
            buf = device_alloc(64 * MiB)
            read.set()
            done.wait(10)
            del buf
            return i

        temporary.__name__ = "inc"
        tasks.binder.gpu_runner("inc-beside", 0.5, "inc")(Task("inc-beside", temporary, 1), {})

    thread = threading.Thread(target=beside)

    def still_alone(key: Any, token: Any) -> bool:
        alone = original(key, token)
        if key == "q-1" and not thread.is_alive() and not read.is_set():
            thread.start()  # packs beside it once it was found alone
            assert read.wait(10)
        return alone

    leases.still_alone = still_alone  # type: ignore[method-assign]

    def q(i: int) -> int:
        return i

    tasks.binder.gpu_runner("q-1", 0.5, "q")(Task("q-1", q, 1), {})  # measured: a new prefix
    done.set()
    thread.join(10)

    def inc_leaky(i: int) -> int:
        device_alloc(4 * MiB, leak=True)
        return i + 1

    inc_leaky.__name__ = "inc"
    for i in range(MAX_GAP):  # one of them measured: from a base of its own, not that one
        tasks.run(inc_leaky, i)
    assert [r for r in tasks.residues if r[0] == "inc" and r[1].get(0)]
