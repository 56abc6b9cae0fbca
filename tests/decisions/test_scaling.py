"""Elastic pools: targets, retirements and what a waiting GPU task waits for, with numbers."""

from __future__ import annotations

import pytest

from accelsched.policy.requirements import DeviceFacts, Requirement
from accelsched.policy.scaling import (
    CPU_DEMAND,
    GPU_DEMAND,
    MINIMUM,
    GpuDemand,
    Pool,
    PoolState,
    counted_from,
    decide,
    keep_a_receiver,
    still_retired,
    to_close,
    workers_for,
)
from accelsched.protocol import WorkerDemand

GiB = 1 << 30
H100 = DeviceFacts("NVIDIA H100 80GB HBM3", 80 * GiB, (9, 0))
T4 = DeviceFacts("Tesla T4", 16 * GiB, (7, 5))

GPU_POOL = Pool("gpu", maximum=2, gpus=1, threads=2)
CPU_POOL = Pool("cpu", maximum=2, threads=2)
BIG = Pool("big", maximum=1, gpus=1, devices=(H100,), threads=4)
SMALL = Pool("small", maximum=3, gpus=1, devices=(T4,), threads=4)
ANY = Requirement()
LARGE = Requirement(memory=60 * GiB)


def gpu_tasks(waiting: int, running: int = 0, need: Requirement = ANY, devices: int = 1):
    """GPU tasks of half a second each (distributed's guess for tasks it has not timed)."""
    seconds = 0.5 * (waiting + running)
    return GpuDemand(f"{devices}x {need.label()}", need, devices, waiting, running, seconds)


@pytest.mark.parametrize(
    "tasks, seconds, slots, target, expected",
    [
        (0, 0.0, 1, 5.0, 0),  # nothing to do: none
        (12, 6.0, 1, 5.0, 2),  # 6 s of work within 5 s: two workers
        (12, 120.0, 1, 5.0, 12),  # long tasks: one each, no more
        (12, 120.0, 4, 5.0, 3),  # four at a time per worker
        (1, 0.01, 1, 5.0, 1),  # a short task still gets a worker
        (3, 100.0, 1, 0.0, 3),  # no target duration: by count
        (5, 1.0, 0, 5.0, 0),  # no slot for it: no worker helps
    ],
)
def test_workers_for(tasks, seconds, slots, target, expected) -> None:
    assert workers_for(tasks, seconds, slots, target) == expected


def test_waiting_gpu_tasks_start_the_gpu_pool_only() -> None:
    """The done-when scenario's first look: 12 GPU tasks of 0.5 s wait, no worker yet."""
    plan = decide([GPU_POOL, CPU_POOL], {}, [gpu_tasks(12)])
    assert plan.targets == {"gpu": 2, "cpu": 0}
    assert plan.reasons == {"gpu": GPU_DEMAND}
    assert plan.coming == {"1x any": "gpu"} and plan.full == {} and plan.retire == []


def test_cpu_work_starts_the_cpu_pool() -> None:
    plan = decide([GPU_POOL, CPU_POOL], {}, [], cpu_tasks=3, cpu_seconds=30.0)
    assert plan.targets == {"gpu": 0, "cpu": 2}  # ceil(3 / 2 threads)
    assert plan.reasons == {"cpu": CPU_DEMAND}


def test_the_minimum_is_kept_and_said() -> None:
    plan = decide([Pool("gpu", minimum=1, maximum=2, gpus=1)], {}, [])
    assert plan.targets == {"gpu": 1} and plan.reasons == {"gpu": MINIMUM}


def test_a_requirement_goes_to_the_pool_whose_devices_meet_it() -> None:
    plan = decide([SMALL, BIG], {}, [gpu_tasks(5, need=LARGE)])
    assert plan.targets == {"small": 0, "big": 1}
    assert plan.coming == {"1x memory>=60GiB": "big"}


def test_a_pool_that_says_nothing_of_its_devices_serves_no_requirement() -> None:
    plan = decide([GPU_POOL], {}, [gpu_tasks(2, need=LARGE)])
    assert plan.targets == {"gpu": 0}
    assert plan.unserved == ["1x memory>=60GiB"] and plan.coming == {} and plan.full == {}


def test_a_class_needing_more_devices_than_a_worker_has_is_unserved() -> None:
    plan = decide([GPU_POOL], {}, [gpu_tasks(1, devices=2)])
    assert plan.targets == {"gpu": 0} and plan.unserved == ["2x any"]


def test_what_one_pool_cannot_take_overflows_to_the_next() -> None:
    first = Pool("first", maximum=1, gpus=1)
    second = Pool("second", maximum=5, gpus=1)
    tasks = GpuDemand("1x any", ANY, 1, waiting=4, running=0, seconds=400.0)
    plan = decide([first, second], {}, [tasks])
    assert plan.targets == {"first": 1, "second": 3}


def test_at_maximum_with_no_worker_starting_the_class_is_full() -> None:
    """Both GPU workers run, 12 more tasks wait: nothing is coming for them."""
    states = {"gpu": PoolState(running=2)}
    plan = decide([GPU_POOL, CPU_POOL], states, [gpu_tasks(12, running=4)])
    assert plan.targets["gpu"] == 2
    assert plan.full == {"1x any": ["gpu"]} and plan.coming == {}


def test_a_pool_below_its_maximum_serving_the_class_is_not_full() -> None:
    """One worker of four runs and is enough by time for the tasks waiting: they wait
    for it, the pool is not full (before: listed in ``full``, and a fallback then said
    ``pools_at_maximum: ['gpu']`` of a pool at one worker of four)."""
    pool = Pool("gpu", maximum=4, gpus=1)
    plan = decide([pool], {"gpu": PoolState(running=1)}, [gpu_tasks(3, running=1)])
    assert plan.targets == {"gpu": 1} and plan.full == {} and plan.coming == {}
    # at four (running, or planned): full
    plan = decide([pool], {"gpu": PoolState(running=4)}, [gpu_tasks(3, running=4)])
    assert plan.full == {"1x any": ["gpu"]}


def test_a_starting_worker_covers_the_class_even_at_maximum() -> None:
    states = {"gpu": PoolState(running=1, starting=1)}
    plan = decide([GPU_POOL], states, [gpu_tasks(3)])
    assert plan.coming == {"1x any": "gpu"} and plan.full == {}


def test_idle_workers_retire_gpu_pools_first_longest_idle_first() -> None:
    states = {
        "cpu": PoolState(running=2, idle={"cpu-0": 100.0, "cpu-1": 100.0}),
        "gpu": PoolState(running=2, idle={"gpu-0": 61.0, "gpu-1": 90.0}),
    }
    plan = decide([CPU_POOL, GPU_POOL], states, [], idle_after=60.0)
    assert plan.retire == ["gpu-1", "gpu-0", "cpu-0", "cpu-1"]


def test_only_workers_idle_long_enough_and_above_the_target_retire() -> None:
    states = {"gpu": PoolState(running=2, idle={"gpu-0": 10.0, "gpu-1": 90.0})}
    assert decide([GPU_POOL], states, [], idle_after=60.0).retire == ["gpu-1"]
    keep_one = Pool("gpu", minimum=1, maximum=2, gpus=1)
    both_idle = {"gpu": PoolState(running=2, idle={"gpu-0": 70.0, "gpu-1": 90.0})}
    assert decide([keep_one], both_idle, [], idle_after=60.0).retire == ["gpu-1"]
    busy = {"gpu": PoolState(running=2, idle={})}  # busy workers never retire
    assert decide([GPU_POOL], busy, [], idle_after=0.0).retire == []


def test_running_gpu_work_keeps_the_pool() -> None:
    states = {"gpu": PoolState(running=2, idle={"gpu-1": 500.0})}
    tasks = GpuDemand("1x any", ANY, 1, waiting=0, running=12, seconds=60.0)
    plan = decide([GPU_POOL], states, [tasks], idle_after=60.0)
    assert plan.targets == {"gpu": 2} and plan.retire == []


@pytest.mark.parametrize(
    "since, coming_until, bound, expected",
    [
        (100.0, None, 60.0, 100.0),  # nothing coming: as today
        (100.0, 90.0, 60.0, 100.0),  # a promise that ended before it waited
        (100.0, 130.0, 60.0, 130.0),  # counts from when the worker was due
        (100.0, 500.0, 60.0, 160.0),  # at most the bound past its start
        (100.0, 130.0, 0.0, 100.0),  # a bound of 0: starting workers hold nothing back
    ],
)
def test_counted_from(since, coming_until, bound, expected) -> None:
    assert counted_from(since, coming_until, bound) == expected


def seen(
    name: str, *, retiring: bool = False, busy: bool = False, holds: bool = False
) -> WorkerDemand:
    """A worker as a demand reply says it (running unless retiring)."""
    return WorkerDemand(
        name=name,
        address=f"tcp://{name}",
        busy=busy,
        gpu_busy=False,
        gpus=1,
        retiring=retiring,
        running=not retiring,
        holds=holds,
    )


def test_retired_workers_are_the_schedulers_and_those_that_left() -> None:
    """A retired worker that left (killed, walltime) before it was closed stays retired,
    so its spec is closed and a new worker may start (not counted as starting for ever);
    one retired by another controller is known; one back in service is a member."""
    listed = {
        "gpu-0": seen("gpu-0", retiring=True),  # another controller's
        "gpu-1": seen("gpu-1"),  # retired before, back in service (its data had no peer)
        "cpu-0": seen("cpu-0"),
    }
    members = ["gpu-0", "gpu-1", "gpu-2", "gpu-3", "cpu-0"]
    before = {"gpu-1", "gpu-2"}  # gpu-2 left; gpu-3 (never retired) is not listed yet
    assert still_retired(before, members, listed) == {"gpu-0", "gpu-2"}
    assert still_retired(set(), members, {}) == set()


def test_retired_workers_close_on_what_the_look_saw() -> None:
    """Closed: retired and idle as this look's reply says, or gone; not one retired after
    the reply (its tasks then are unknown), nor one still running a task, nor one whose
    results found no peer before its retry is due."""
    listed = {
        "a": seen("a", retiring=True),
        "b": seen("b", retiring=True, busy=True),
        "c": seen("c"),  # retired during this look: the reply predates it
        "d": seen("d", retiring=True),
    }
    retired = {"a", "b", "c", "d", "gone"}
    assert to_close(retired, listed, {"d": 105.0}, now=100.0) == ["a", "gone"]
    assert to_close(retired, listed, {"d": 105.0}, now=105.0) == ["a", "d", "gone"]


def test_workers_retired_together_keep_one_to_take_their_results() -> None:
    """Two idle workers holding results, both proposed and nobody else running: retired
    together neither could take the other's (each refusal two warnings in the scheduler's
    log), so the last one proposed stays and takes the first's."""
    both = {"gpu-0": seen("gpu-0", holds=True), "cpu-0": seen("cpu-0", holds=True)}
    assert keep_a_receiver(["gpu-0", "cpu-0"], both) == ["gpu-0"]
    with_peer = {**both, "cpu-1": seen("cpu-1")}
    assert keep_a_receiver(["gpu-0", "cpu-0"], with_peer) == ["gpu-0", "cpu-0"]
    empty = {"gpu-0": seen("gpu-0"), "cpu-0": seen("cpu-0")}  # nothing to move
    assert keep_a_receiver(["gpu-0", "cpu-0"], empty) == ["gpu-0", "cpu-0"]
    retiring_peer = {**both, "cpu-1": seen("cpu-1", retiring=True)}  # no receiver
    assert keep_a_receiver(["gpu-0", "cpu-0"], retiring_peer) == ["gpu-0"]
    # the GPU worker holds, the CPU one not: the CPU one (proposed last, the cheaper)
    # stays and takes the GPU worker's results, rather than keep the GPU worker up
    gpu_holds = {"gpu-0": seen("gpu-0", holds=True), "cpu-0": seen("cpu-0")}
    assert keep_a_receiver(["gpu-0", "cpu-0"], gpu_holds) == ["gpu-0"]
