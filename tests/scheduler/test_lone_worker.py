"""A lone GPU worker whose restart was given up because its peer died: it waits, in
quarantine, for a peer to take its data, says so in ``accelsched status``, and restarts
as soon as one joins; the strict GPU tasks that waited meanwhile run once each."""

from __future__ import annotations

from distributed import Event, Nanny
from distributed.utils_test import gen_cluster

import accelsched
from accelsched.testing import fake_gpus
from tests.utils import FAST, cli, cvd, events, gpus, hold, leaky, ran_on_gpu, wait_for


def test_a_lone_gpu_worker_whose_peer_died_restarts_when_a_peer_joins(tmp_path) -> None:  # type: ignore[no-untyped-def]
    @gen_cluster(
        client=True,
        Worker=Nanny,
        nthreads=[("127.0.0.1", 2, cvd("0")), ("127.0.0.1", 1, cvd(""))],
        timeout=120,
    )
    async def run(c, s, a, b):  # type: ignore[no-untyped-def]
        await accelsched.register(c, **FAST)
        A = a.worker_address
        await wait_for(lambda: gpus(s, A) == 1, 30)
        kept = await c.scatter({"kept": 42}, workers=[A])
        # the drain waits for it
        busy = c.submit(hold, "busy", returns="busy", workers=[A], key="busy")
        await wait_for(
            lambda: s.tasks.get("busy") is not None and s.tasks["busy"].state == "processing"
        )
        assert await c.submit(leaky, 1, resources={"GPU": 1}, key="leak") == 1
        await wait_for(lambda: events(s, "leak"), 30)
        await wait_for(lambda: s.workers[A].status.name == "closing_gracefully", 30)  # draining
        await b.close()  # the only peer dies while the restart drains
        await wait_for(lambda: list(s.workers) == [A], 30)
        await Event("busy").set()
        await wait_for(lambda: events(s, "quarantine"), 30)
        (quarantine,) = events(s, "quarantine")
        assert quarantine["worker"] == A and quarantine["reason"] == "restart-deferred: no-peer"
        path = str(tmp_path / "runs")
        futures = c.map(
            ran_on_gpu, [path] * 4, range(4), key=[f"g-{i}" for i in range(4)], resources={"GPU": 1}
        )
        # accelsched status says why, and what it waits for
        code, out, err = await cli("status", s.address)
        assert code == 0, err
        assert (
            "restart-deferred: no-peer; waits for a peer to take its data, or to hold and "
            "run nothing" in out
        ), out

        async with Nanny(s.address, nthreads=1, env={"CUDA_VISIBLE_DEVICES": ""}):
            await wait_for(lambda: events(s, "restart"), 60)
            (restart,) = events(s, "restart")
            assert restart["worker"] == A and restart["reason"] == "leak"
            await wait_for(lambda: any(gpus(s, w) == 1 for w in s.workers), 60)
            assert await c.gather(futures) == [0] * 4
            with open(path) as f:
                assert sorted(int(line) for line in f) == list(range(4))  # each ran once
            assert await kept["kept"] == 42
            assert await busy == "busy"

    with fake_gpus(1):
        run()
