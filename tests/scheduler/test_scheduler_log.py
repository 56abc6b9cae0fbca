"""What an operator reads in the scheduler's log: every restart, fallback and device
withdrawal once, in words, with its reason (the workers' events too, which distributed's
own lines never explain: ``Retire worker ... stimulus_id='accelsched-restart-...'``)."""

from __future__ import annotations

import logging
from contextlib import AsyncExitStack

import dask
import pytest
from distributed.utils_test import captured_logger, gen_cluster

import accelsched
from accelsched.testing import fake_gpus
from tests.utils import events, gpus, leak_and_restart, named_nannies, wait_for

#: Where the scheduler's parts log (the in-process workers' guards log elsewhere).
SCHEDULER_LOG = "accelsched.scheduler"


@pytest.mark.usefixtures("fake_gpus_2")
@gen_cluster(client=True, nthreads=[], timeout=120)
async def test_a_leak_restart_is_logged_once_with_its_reason(c, s):
    async with AsyncExitStack() as stack:
        alpha, _ = await named_nannies(stack, s)
        old = alpha.worker_address
        with captured_logger(SCHEDULER_LOG, level=logging.INFO) as log:
            await leak_and_restart(c, s, alpha)
        lines = log.getvalue().splitlines()
    (leak,) = [line for line in lines if line.startswith("accelsched [leak]")]
    assert leak.startswith(f"accelsched [leak] {old}: device 0 leaks ") and "MiB" in leak
    (begun,) = [line for line in lines if line.startswith("accelsched: restarting")]
    assert begun.startswith(f"accelsched: restarting {old} (leak): ")
    assert "stimulus_id accelsched-restart-leak-" in begun  # distributed's Retire line's
    (done,) = [line for line in lines if line.startswith("accelsched [restart]")]
    assert done.startswith(f"accelsched [restart] {old}: retired (") and done.endswith("(leak)")
    assert not any("{" in line for line in lines), lines  # no raw dict


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_a_fallback_is_logged_once_with_its_reason(c, s, a):
    await accelsched.register(c, fallback_timeout="300ms")
    step = accelsched.dual(lambda x: ("gpu", x), lambda x: ("cpu", x))
    with captured_logger(SCHEDULER_LOG, level=logging.INFO) as log:
        with dask.annotate(resources={"GPU": 1}):
            assert await c.submit(step, 1, key="x") == ("cpu", 1)
        await wait_for(lambda: events(s, "fallback"))
    (line,) = [x for x in log.getvalue().splitlines() if x.startswith("accelsched [fallback]")]
    assert line.startswith("accelsched [fallback] task 'x': fell back to its CPU form after ")
    assert line.endswith("s (timeout)")


def test_a_device_withdrawn_is_logged_once_on_the_scheduler() -> None:
    """The worker's ``gpu-unhealthy`` event, in the scheduler's log, at WARNING."""

    @gen_cluster(client=True, nthreads=[("127.0.0.1", 2, {"resources": {"GPU": 2}})], timeout=60)
    async def run(c, s, a):  # type: ignore[no-untyped-def]
        await accelsched.register(c, check_interval="50ms")
        await wait_for(lambda: gpus(s, a.address) == 2)
        with captured_logger(SCHEDULER_LOG, level=logging.WARNING) as log:
            g.fail(1, "all")
            await wait_for(lambda: gpus(s, a.address) == 1)
            await wait_for(lambda: events(s, "gpu-unhealthy"))
            await wait_for(lambda: "gpu-unhealthy" in log.getvalue())
        (line,) = log.getvalue().splitlines()
        (uuid,) = [e["uuid"] for e in events(s, "gpu-unhealthy")]
        assert line.startswith(
            f"accelsched [gpu-unhealthy] {a.address}: device 1 ({uuid}) stopped answering "
            "NVML: withdrawn ("
        ), line

    with fake_gpus(2) as g:
        run()
