"""What the guard costs per task, counted (not timed): NVML reads and pool frees.

Reading NVML costs tens of microseconds per device; these tests count the reads the
guard makes around tasks on a real cluster (in-process workers, so the count can be
taken on the worker's own monitor) against the fake NVML.
"""

from __future__ import annotations

import time

import pytest
from distributed.utils_test import gen_cluster

import accelsched
from accelsched.policy.leak import MAX_WAIT
from accelsched.testing import device_alloc
from accelsched.worker.guard_plugin import EVERY, FIRST_RUNS, Watch
from tests.utils import GiB, MiB, gpus, inc, wait_for

pytestmark = pytest.mark.usefixtures("fake_gpus_2")

QUIET = dict(check_interval="1h")  # no periodic leak check reading NVML meanwhile


def count_reads(worker) -> list[int]:  # type: ignore[no-untyped-def]
    """Count the guard's per-process NVML reads on ``worker`` from now on."""
    monitor = worker.plugins["accelsched-guard"].inventory.monitor
    counter = [0]
    read = monitor.process_memory

    def counted(device: int):  # type: ignore[no-untyped-def]
        counter[0] += 1
        return read(device)

    monitor.process_memory = counted
    return counter


def small(i: int) -> int:
    device_alloc(MiB)  # a temporary: 1 MiB back to the pool
    return i


def big(i: int) -> int:
    device_alloc(256 * MiB)  # a temporary: 256 MiB back to the pool
    return i


def test_the_watch_samples_per_prefix() -> None:
    watch = Watch(monitor=None, visible=[], fail=False, emit=print)  # type: ignore[arg-type]
    runs = [watch.sampled("inc") for _ in range(3 * EVERY)]
    watched = [i + 1 for i, w in enumerate(runs) if w]
    assert watched == [*range(1, FIRST_RUNS + 1), EVERY, 2 * EVERY, 3 * EVERY]
    assert watch.sampled("other")  # each prefix starts watched
    strict = Watch(monitor=None, visible=[], fail=True, emit=print)  # type: ignore[arg-type]
    assert all(strict.sampled("inc") for _ in range(100))  # "fail" watches every run


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1, {"resources": {"GPU": 2}})])
async def test_cpu_tasks_cost_o1_nvml_reads(c, s, a):
    await accelsched.register(c, **QUIET)
    await wait_for(lambda: gpus(s, a.address) == 2)
    reads = count_reads(a)
    n = 3 * EVERY
    assert await c.gather(c.map(inc, range(n))) == [i + 1 for i in range(n)]
    # 2 visible devices, read before and after each watched run: the first runs and one
    # in EVERY, not 2 * 2 * n
    watched = FIRST_RUNS + n // EVERY
    assert 0 < reads[0] <= 2 * 2 * watched < n


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1, {"resources": {"GPU": 2}})])
async def test_back_to_back_gpu_tasks_read_each_device_once(c, s, a):
    await accelsched.register(c, **QUIET)
    await wait_for(lambda: gpus(s, a.address) == 2)
    await c.submit(small, -1, resources={"GPU": 1})  # the CUDA context exists now
    reads = count_reads(a)
    n = 20
    start = time.monotonic()
    futs = c.map(small, range(n), resources={"GPU": 1})  # kept: nothing released between
    assert await c.gather(futs) == list(range(n))
    # at most one closing reading per measured task (its base is the previous task's
    # closing reading), plus a base per device when the previous reading there is
    # unknown; and a prefix whose runs leave nothing is measured on a sample of its runs
    # (accelsched.policy.leak): 6 or 7 of these 20 by their count (the first run may have
    # counted), and one more at most per MAX_WAIT these runs took (a slow machine's)
    by_time = int((time.monotonic() - start) / MAX_WAIT) + 1
    assert sampled(n, before=1) <= reads[0] <= sampled(n) + 2 + by_time, reads


def sampled(runs: int, before: int = 0) -> int:
    """How many of ``runs`` quiet runs of a prefix are measured by their count, after
    ``before``."""
    from accelsched.policy.leak import Backoff

    backoff, measured = Backoff(clock=lambda: 0.0), 0  # by their count alone
    for i in range(before + runs):
        if backoff.measure("p"):
            measured += i >= before
            backoff.measured("p", False)
    return measured


def cached_here() -> int:
    from accelsched.devices import POOLS
    from accelsched.testing import SimulatedPool

    (pool,) = [p for p in POOLS if isinstance(p, SimulatedPool)]
    return sum(pool.stats(d).cached for d in (0, 1))


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1, {"resources": {"GPU": 1}})])
async def test_pools_are_freed_only_when_they_cache_enough(c, s, a):
    await accelsched.register(c, free_pools_min="64MiB", **QUIET)
    await wait_for(lambda: gpus(s, a.address) == 1)
    await c.submit(small, 0, resources={"GPU": 1})
    assert cached_here() == MiB  # 1 MiB cached: not worth a free
    await c.submit(big, 1, resources={"GPU": 1})
    assert cached_here() == 0  # 256 MiB cached: freed


def test_free_pools_min_is_validated() -> None:
    with pytest.raises(ValueError, match="free_pools_min"):
        accelsched.GuardPlugin(free_pools_min="-1MiB")
    with pytest.raises(TypeError, match="free_pools_min"):
        accelsched.GuardPlugin(free_pools_min=1.5)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1, {"resources": {"GPU": 2}})])
async def test_gpu_gauge_is_read_at_scrape_time(c, s, a):
    prometheus_client = pytest.importorskip("prometheus_client")
    await accelsched.register(c, **QUIET)
    await wait_for(lambda: gpus(s, a.address) == 2)

    def gauge(state: str) -> float | None:
        return prometheus_client.REGISTRY.get_sample_value("accelsched_gpus", {"state": state})

    assert gauge("verified") == 2 and gauge("quarantined") == 0
    s.plugins["accelsched-placement"].quarantine(a.address, "test")
    assert gauge("verified") == 0 and gauge("quarantined") == 2
    await c.unregister_scheduler_plugin("accelsched-placement")
    # no plugin, no grants: the gauge neither shows the gone plugin's nor holds it
    assert gauge("verified") == 0 and gauge("quarantined") == 0


class _Pool:
    """A pool as the PoolFreer sees it (the protocol's three calls; no device needed)."""

    name = "t"

    def __init__(self, stats: object) -> None:
        self._stats = stats
        self.freed = 0

    def active(self) -> bool:
        return True

    def free_all(self) -> int:
        self.freed += 1
        return 0

    def stats(self, device: int) -> object:
        return self._stats


def test_freeing_waits_for_a_cache_worth_it_except_under_rmm() -> None:
    from accelsched.devices import PoolStats
    from accelsched.worker.guard_plugin import caches_enough

    def enough(stats: PoolStats) -> bool:
        return caches_enough([_Pool(stats)], (0,), 64 * MiB)  # type: ignore[list-item]

    assert not enough(PoolStats(cached=MiB))
    assert enough(PoolStats(cached=64 * MiB))
    # RMM owns the device pool (a fixed reserve, nothing cached): the pinned pool is
    # still freed, as before the threshold existed
    assert enough(PoolStats(held=GiB, fixed=GiB))

    class Inactive(_Pool):  # CuPy not imported: never asked, its cache counts for nothing
        def active(self) -> bool:
            return False

        def stats(self, device: int) -> object:
            raise AssertionError("an inactive pool was asked what it caches")

    cached = _Pool(PoolStats(cached=32 * MiB))
    both = [Inactive(PoolStats(cached=GiB)), cached, cached]
    assert not caches_enough(both[:2], (0,), 64 * MiB)  # type: ignore[arg-type]
    assert caches_enough(both, (0,), 64 * MiB)  # type: ignore[arg-type]  # 32 + 32
