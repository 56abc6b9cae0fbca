"""No single task, mark or annotation may harm a worker or another task.

Each case sends one bad task beside good ones on a real cluster (scheduler validation on)
and checks that the bad one ends alone — falls back or errs, naming its value — while the
good ones finish and every worker stays.
"""

from __future__ import annotations

import dask
import pytest
from distributed.utils_test import gen_cluster

import accelsched
from accelsched.policy.marks import Mark
from accelsched.policy.timeouts import MAX_GPUS
from tests.utils import events, wait_for

#: One worker with a (fake) GPU, one without.
GPU_AND_CPU = [("127.0.0.1", 1, {"resources": {"GPU": 1}}), ("127.0.0.1", 1)]


def where(x: int) -> tuple[str, int]:
    return ("gpu" if accelsched.current_device() is not None else "cpu", x)


@pytest.mark.usefixtures("fake_gpus_2")
@pytest.mark.parametrize("amount", [2**64, 10**30, MAX_GPUS + 1])
@pytest.mark.parametrize("default", [True, False], ids=["plugin-default", "per-task"])
@gen_cluster(client=True, nthreads=GPU_AND_CPU, timeout=60)
async def test_more_gpus_than_any_worker_can_have_fall_back_at_once(c, s, a, b, amount, default):
    """Before: the fallback lifted the restriction but sent the annotation on; the
    worker's message could not be serialised (OverflowError), its stream died and both
    workers were removed, taking the good GPU task with them."""
    await accelsched.register(c, fallback_timeout="30s" if default else None)
    per_task = {} if default else {"fallback_timeout": "30s"}
    with dask.annotate(resources={"GPU": amount}, **per_task):
        huge = c.submit(where, 1, key="huge")
    with dask.annotate(resources={"GPU": 1}):
        good = c.submit(where, 2, key="good")
    assert await huge == ("cpu", 1)  # at once, not after 30 s (the test's timeout is 60)
    assert await good == ("gpu", 2)
    (e,) = events(s, "fallback")
    assert e["key"] == "huge" and e["reason"] == "unsatisfiable" and e["waited"] < 5
    assert set(s.workers) == {a.address, b.address}
    assert "GPU" not in s.tasks["huge"].annotations["resources"]


@pytest.mark.usefixtures("fake_gpus_2")
@gen_cluster(client=True, nthreads=GPU_AND_CPU, timeout=60)
async def test_a_strict_task_no_worker_can_ever_take_errs_alone(c, s, a, b):
    await accelsched.register(c)
    with dask.annotate(resources={"GPU": 2**64}):
        huge = c.submit(where, 1, key="huge")
    with dask.annotate(resources={"GPU": 1}):
        good = c.submit(where, 2, key="good")
    with pytest.raises(ValueError, match=r"'GPU': 18446744073709551616.*more than 65536 GPUs"):
        await huge
    assert await good == ("gpu", 2)
    assert set(s.workers) == {a.address, b.address}
    assert not events(s, "fallback")


def forged(mark: Mark) -> accelsched.GPUStep:  # type: ignore[name-defined]
    """A step whose mark says what no ``gpu()`` call would accept (unpickled data can)."""
    step = accelsched.gpu(where)
    step.__accelsched_gpu__ = mark  # type: ignore[misc]
    return step


@pytest.mark.parametrize(
    "mark, named",
    [
        (Mark(count=1, timeout=float("nan"), timeout_given=True), "fallback_timeout=nan"),
        (Mark(count=1, timeout="1s", timeout_given=True), "fallback_timeout='1s'"),  # type: ignore[arg-type]
        (Mark(count=1, timeout=-1.0, timeout_given=True), "fallback_timeout=-1.0"),
        (Mark(count=float("inf")), "count=inf"),
        (Mark(count="2"), "count='2'"),  # type: ignore[arg-type]
    ],
    ids=["nan", "string", "negative", "inf-count", "string-count"],
)
@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)], timeout=60)
async def test_a_bad_mark_from_unpickled_data_errs_alone(c, s, a, mark, named):
    """Before: a NaN deadline sat on top of the fallback heap, ``deadline <= now`` was
    never true, and the valid 1 s fallbacks queued behind it never happened. (No GPU in
    this cluster: every good task must fall back.)"""
    await accelsched.register(c)
    bad = c.submit(forged(mark), 1, key="bad")
    quick = accelsched.gpu(fallback_timeout="200ms")(where)
    goods = c.map(quick, range(3), key=[f"good-{i}" for i in range(3)])
    assert await c.gather(goods) == [("cpu", i) for i in range(3)]  # no GPU: all fell back
    with pytest.raises(ValueError, match=f"invalid GPU step mark {named}"):
        await bad
    await wait_for(lambda: len(events(s, "fallback")) == 3)
