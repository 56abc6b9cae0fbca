"""Who may speak for a worker, and odd GPU amounts: nothing changes on anyone's word but
the worker's own, and no task can take down a worker. Real nanny workers on fake GPUs."""

from __future__ import annotations

import copy
from typing import Any

import dask
import pytest
from distributed import Nanny
from distributed.core import rpc
from distributed.utils_test import gen_cluster

import accelsched
from accelsched.policy.requirements import capacity, mebibytes
from tests.utils import background, cvd, events, gpus, settled, wait_for

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
        "grants": {a: (grants.reported(a), copy.deepcopy(grants.of(a))) for a in s.workers},
        "owners": dict(grants.registry.owners),
        "workers": set(s.workers),
        "budget": s.plugins["accelsched-placement"].restarts.budget.in_flight,
    }


async def outstanding_request(c: Any, worker: str) -> str:
    """A request id ``worker`` itself has outstanding: the best a forger could lay hands on."""
    ids = await c.run(
        lambda dask_worker: dask_worker.plugins["accelsched-guard"].inventory.pending.new(
            "accelsched_inventory", {}
        ),
        workers=[worker],
    )
    return ids[worker]


@gen_cluster(client=True, Worker=Nanny, nthreads=WORKERS, timeout=90)
async def test_nobody_but_a_worker_speaks_for_it(c, s, a, b, g):
    await accelsched.register(c)
    A, B, G = a.worker_address, b.worker_address, g.worker_address
    await wait_for(lambda: gpus(s, A) == 1 and gpus(s, B) == 1)
    published = {e["worker"]: list(e["devices"]) for e in events(s, "gpu-verified")}
    before = snapshot(s)
    # what an attacker can find: every worker's published devices, and request ids the
    # workers really have outstanding (their own, not the target's)
    ids = {w: await outstanding_request(c, w) for w in (A, B, G)}
    candidates: list[tuple[str, dict[str, Any]]] = []
    for request in ("", "guess", *ids.values()):
        candidates += [
            # release a's GPU / give b's GPU to a / a GPU-less worker takes a's GPU
            (
                "accelsched_inventory",
                dict(worker=A, devices=[], requested=0, declared=1, request=request),
            ),
            (
                "accelsched_inventory",
                dict(worker=A, devices=published[B], requested=1, request=request),
            ),
            (
                "accelsched_inventory",
                dict(worker=G, devices=published[A], requested=1, request=request),
            ),
            # inflate b with made-up UUIDs
            (
                "accelsched_inventory",
                dict(
                    worker=B,
                    devices=published[B] + [{**published[B][0], "uuid": "GPU-made-up"}],
                    requested=2,
                    request=request,
                ),
            ),
            # restart b, or spend its budget until it is quarantined
            *[("accelsched_restart", dict(worker=B, request=request, reason="leak"))] * 4,
        ]
    # a worker's own outstanding id never leaves it: a forger only has the others'
    forged = [(h, kw) for h, kw in candidates if kw["request"] != ids[kw["worker"]]]
    started = background(s)
    # ... from a client connection
    async with rpc(s.address) as r:
        for handler, kwargs in forged:
            reply = await getattr(r, handler)(**kwargs)
            assert reply["status"] == "refused", (handler, kwargs, reply)
    # ... and from another worker's own connection to the scheduler
    for handler, kwargs in forged[:8]:
        reply = await c.run(
            _call_scheduler, handler, kwargs, workers=[G if kwargs["worker"] != G else A]
        )
        assert next(iter(reply.values()))["status"] == "refused", (handler, kwargs)
    await settled(s, started)  # whatever the requests set going (a restart...) is over
    assert snapshot(s) == before
    assert not events(s, "restart") and not events(s, "quarantine")
    assert not events(s, "restart-deferred")
    # each refused, logged once a minute per worker and handler: a flood pushes nothing out
    refused = events(s, "request-refused")
    pairs = [(e["worker"], e["handler"]) for e in refused]
    assert sorted(pairs) == sorted({(kw["worker"], h) for h, kw in forged}), (
        "one event per worker and handler"
    )
    # the workers' own handlers give nothing away and change nothing
    started = background(s)
    async with rpc(A) as worker:
        assert await worker.accelsched_confirm(request="guess") == {"confirmed": False}
        assert (await worker.accelsched_report())["status"] == "OK"  # awaits the scheduler
    await settled(s, started)
    assert snapshot(s) == before
    # and a GPU task still runs on a verified GPU
    with dask.annotate(resources={"GPU": 1}):
        assert await c.submit(accelsched.current_device, pure=False) == 0


async def _call_scheduler(handler: str, kwargs: dict, dask_worker: Any) -> dict:
    """Runs on a worker: call the scheduler over that worker's own connection pool."""
    return await getattr(dask_worker.scheduler, handler)(**kwargs)


# --- odd GPU amounts ----------------------------------------------------------------------


@pytest.mark.parametrize("amount", [0, -1, float("nan"), float("inf"), "1", None, [1]])
def test_odd_gpu_amounts_err_and_harm_no_worker(amount: object) -> None:
    """Zero, negative, NaN, infinite or no number at all: that task errs, naming it."""

    @gen_cluster(client=True, Worker=Nanny, nthreads=WORKERS, timeout=60)
    async def run(c, s, a, b, g):  # type: ignore[no-untyped-def]
        await accelsched.register(c)
        await wait_for(lambda: gpus(s, a.worker_address) == 1)
        with dask.annotate(resources={"GPU": amount}):
            bad = c.submit(int, 1, key="odd")
        with pytest.raises(ValueError, match=r"invalid resources=\{'GPU'"):
            await bad
        # every worker survived, and GPU work goes on
        assert len(s.workers) == 3
        with dask.annotate(resources={"GPU": 1}):
            assert await c.submit(accelsched.current_device, pure=False) == 0
        assert await c.submit(int, 2, workers=[g.worker_address], pure=False) == 2

    run()


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
    assert "ValueError: invalid check_interval=''" in out.stderr


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
