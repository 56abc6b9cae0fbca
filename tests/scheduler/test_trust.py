"""Odd GPU amounts and declarations, ``set_resources`` from anyone: no GPU count changes
but by a worker's verified report, and no task can take down a worker. Real nanny
workers on fake GPUs."""

from __future__ import annotations

import copy
import re
from typing import Any

import dask
import pytest
from distributed import Nanny
from distributed.core import rpc
from distributed.utils_test import gen_cluster

import accelsched
from accelsched.policy.requirements import capacity, mebibytes
from tests.utils import cvd, events, gpus, wait_for

pytestmark = pytest.mark.usefixtures("fake_gpus_2")


#: a (GPU 0, declares 1), b (GPU 1, declares 1), g (no GPU, declares none)
WORKERS = [
    ("127.0.0.1", 1, cvd("0", resources={"GPU": 1})),
    ("127.0.0.1", 1, cvd("1", resources={"GPU": 1})),
    ("127.0.0.1", 1, cvd("")),
]


def snapshot(s: Any) -> dict[str, Any]:
    """Everything a forged request could change, on the scheduler."""
    grants = s.plugins["accelsched-placement"].grants
    return {
        "resources": copy.deepcopy(s.resources),
        "worker_resources": {a: dict(ws.resources) for a, ws in s.workers.items()},
        "grants": {a: copy.deepcopy(grants.of(a)) for a in s.workers},
        "records": copy.deepcopy(dict(grants._workers)),  # every worker's, owners too
        "workers": set(s.workers),
        "budget": s.plugins["accelsched-placement"].budget.in_flight,
    }


# --- odd GPU amounts ----------------------------------------------------------------------


#: Zero, negative, NaN, infinite or no number at all.
ODD_AMOUNTS: list[object] = [0, -1, float("nan"), float("inf"), "1", None, [1]]


@gen_cluster(client=True, Worker=Nanny, nthreads=WORKERS, timeout=60)
async def test_odd_gpu_amounts_err_and_harm_no_worker(c, s, a, b, g):
    """Each odd amount in turn on one cluster: that task errs, naming it, every worker is
    the same process after it, and GPU work goes on."""
    await accelsched.register(c)
    await wait_for(lambda: gpus(s, a.worker_address) == 1)
    workers = set(s.workers)  # a worker a task took down comes back at another address
    for i, amount in enumerate(ODD_AMOUNTS):
        with dask.annotate(resources={"GPU": amount}):
            bad = c.submit(int, 1, key=f"odd-{i}")
        with pytest.raises(ValueError, match=re.escape(f"invalid resources={{'GPU': {amount!r}}}")):
            await bad
        assert set(s.workers) == workers, f"resources={{'GPU': {amount!r}}} cost a worker"
        with dask.annotate(resources={"GPU": 1}):
            assert await c.submit(accelsched.current_device, pure=False) == 0
        assert await c.submit(int, 2, workers=[g.worker_address], pure=False) == 2


@gen_cluster(client=True, Worker=Nanny, nthreads=WORKERS, timeout=60)
async def test_workers_without_gpus_stay_out_of_the_gpu_resource(c, s, a, b, g):
    before = {addr: dict(ws.resources) for addr, ws in s.workers.items()}
    assert "GPU" not in before[g.worker_address]
    await accelsched.register(c)
    await wait_for(lambda: gpus(s, a.worker_address) == 1 and gpus(s, b.worker_address) == 1)
    assert g.worker_address not in s.resources["GPU"]
    assert "GPU" not in s.workers[g.worker_address].resources
    await c.unregister_scheduler_plugin("accelsched-placement")
    # unregistered: every declaration as it was; the guards (still registered) advertise
    # their devices' declared-memory capacity beside them, the GPU-less worker none
    after = {addr: dict(ws.resources) for addr, ws in s.workers.items()}
    memory = {addr: r.pop("GPU-memory", None) for addr, r in after.items()}
    assert after == before
    one = mebibytes(capacity(16 * 2**30))
    assert memory == {a.worker_address: one, b.worker_address: one, g.worker_address: None}
    assert set(s.resources["GPU"]) == {a.worker_address, b.worker_address}


# --- one bad annotation errs alone ----------------------------------------------------------


@gen_cluster(client=True, Worker=Nanny, nthreads=[("127.0.0.1", 1, cvd(""))], timeout=30)
async def test_a_bad_annotation_errs_alone_and_neighbours_keep_theirs(c, s, a):
    """No GPU anywhere: the valid tasks of the same submission fall back as annotated."""
    await accelsched.register(c)  # no default timeout: strict unless annotated
    futures = {}
    for key, timeout in [("ok-0", 0), ("bad-empty", ""), ("bad-huge", "1e400s"), ("ok-1", "1s")]:
        with dask.annotate(resources={"GPU": 1}, fallback_timeout=timeout):
            futures[key] = c.submit(int, 7, key=key)
    assert await futures["ok-0"] == 7 and await futures["ok-1"] == 7
    for key, value in [("bad-empty", "''"), ("bad-huge", "'1e400s'")]:
        with pytest.raises(ValueError, match=rf"fallback_timeout annotation={value}"):
            await futures[key]
    reasons = {e["key"]: e["reason"] for e in events(s, "fallback")}
    assert reasons == {"ok-0": "no-gpu-capacity", "ok-1": "timeout"}


# --- worker declarations that are no count ------------------------------------------------


@pytest.mark.parametrize("declared", ["two", float("nan"), -1])
def test_a_declaration_that_is_no_count_harms_nobody(declared: object) -> None:
    @gen_cluster(
        client=True,
        Worker=Nanny,
        nthreads=[("127.0.0.1", 1, cvd("0", resources={"GPU": declared}))],
        timeout=60,
    )
    async def run(c, s, a):  # type: ignore[no-untyped-def]
        await accelsched.register(c)  # no bare TypeError from the worker's setup
        await wait_for(lambda: events(s, "gpu-corrected"))
        (e,) = events(s, "gpu-corrected")
        assert e["reason"] == f"invalid-declaration: {declared!r}" and e["granted"] == 0
        assert gpus(s, a.worker_address) == 0
        # the worker lives, runs plain tasks, and no GPU task is stranded on it
        assert await c.submit(int, 3, pure=False) == 3
        with dask.annotate(resources={"GPU": 1}, fallback_timeout=0):
            assert await c.submit(accelsched.current_device, key="gpu") is None
        assert s.tasks["gpu"].annotations.get("accelsched_fallback") == "no-gpu-capacity"

    run()


# --- an empty environment value -------------------------------------------------------------


def test_an_empty_environment_value_names_the_option() -> None:
    import os
    import subprocess
    import sys

    env = dict(os.environ, DASK_ACCELSCHED__GUARD__CHECK_INTERVAL="")
    out = subprocess.run(
        [sys.executable, "-c", "import accelsched; accelsched.GuardPlugin()"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 1
    said = "ValueError: dask config accelsched.guard.check-interval: invalid check_interval=''"
    assert said in out.stderr  # (where it came from: nobody typed it where the error shows)


# --- set_resources from anyone --------------------------------------------------------


@gen_cluster(client=True, Worker=Nanny, nthreads=WORKERS, timeout=60)
async def test_set_resources_from_anyone_changes_no_gpu_count(c, s, a, b, g):
    await accelsched.register(c)
    A, G = a.worker_address, g.worker_address
    await wait_for(lambda: gpus(s, A) == 1 and gpus(s, b.worker_address) == 1)
    before = snapshot(s)
    async with rpc(s.address) as r:
        for value in (0, -5, float("nan"), 3):
            await r.set_resources(worker=A, resources={"GPU": value})
        await r.set_resources(worker=G, resources={"GPU": 3})
    assert snapshot(s) == before  # G stays out of the GPU resource, A keeps its one
    assert "GPU" not in s.workers[G].resources
    with dask.annotate(resources={"GPU": 1}):
        assert await c.submit(accelsched.current_device, pure=False) == 0
