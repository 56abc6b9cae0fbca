"""Workers registering one by one: does accelsched's work per registration grow?

Up to 112 in-process workers (16 simulated GPUs split into 7 MIG devices each), each
owning one device, start one after the other against one scheduler. Timed: each from
start to its GPU verified, the scheduler's inventory and offer handlers, and
accelsched's own synchronous work on the event loop per registration. Part of the
``scale`` benchmark.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

import accelsched
from accelsched.protocol import PLACEMENT_PLUGIN


async def _register_workers(n: int, uuids: list[str]) -> dict[str, Any]:
    """Start ``n`` in-process workers one by one, each owning one (MIG) device; time
    each from start to its GPU verified, and the scheduler's accelsched handlers."""
    import inspect
    import os

    from distributed import Client as AsyncClient
    from distributed import Scheduler, Worker

    from accelsched.protocol import INVENTORY_HANDLER, OFFER_HANDLER

    spent: dict[str, list[float]] = {INVENTORY_HANDLER: [], OFFER_HANDLER: []}
    verify: list[float] = []
    workers: list[Worker] = []
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    async with (
        Scheduler(port=0, dashboard_address=":0") as s,
        AsyncClient(s.address, asynchronous=True) as c,
    ):
        await accelsched.register(c, check_interval="1h")  # type: ignore[misc]
        for name in spent:  # time the handlers the guards call
            handler = s.handlers[name]

            def timing(handler: Any, name: str) -> Any:
                async def timed(comm: Any = None, **kw: Any) -> Any:
                    t0 = time.perf_counter()
                    out = handler(comm, **kw)
                    if inspect.isawaitable(out):  # the offer handler waits; the report does not
                        out = await out
                    spent[name].append(time.perf_counter() - t0)
                    return out

                return timed

            s.handlers[name] = timing(handler, name)
        # accelsched's own work on the event loop
        plugin = s.plugins[PLACEMENT_PLUGIN]
        own: list[float] = []

        def sync_timing(obj: Any, attr: str) -> None:
            original = getattr(obj, attr)

            def timed_sync(*a: Any, **kw: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return original(*a, **kw)
                finally:
                    own.append(time.perf_counter() - t0)

            setattr(obj, attr, timed_sync)

        for obj, attr in (
            (plugin.grants, "claim"),
            (plugin.reports, "place"),
            (plugin.reports, "_emit"),
            (plugin.reports, "add_worker"),
            (plugin.status_history, "add_worker"),
        ):
            if hasattr(obj, attr):
                sync_timing(obj, attr)
        own_per_worker: list[float] = []
        try:
            for i in range(n):
                os.environ["CUDA_VISIBLE_DEVICES"] = uuids[i]  # read by the guard's probe
                t0 = time.perf_counter()
                w = await Worker(s.address, nthreads=1, resources={"GPU": 1}, name=f"w{i}")
                workers.append(w)
                while s.workers[w.address].resources.get("GPU", 0) < 1:
                    await asyncio.sleep(0.001)
                verify.append(time.perf_counter() - t0)
                own_per_worker.append(sum(own))
                own.clear()
            verified = sum(1 for ws in s.workers.values() if ws.resources.get("GPU", 0) >= 1)
        finally:
            if saved is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = saved
            await asyncio.gather(*(w.close() for w in workers))
    tenth = max(1, n // 10)

    def ms(values: list[float]) -> float:
        return round(statistics.median(values) * 1e3, 2)

    calls = sorted(spent[INVENTORY_HANDLER] + spent[OFFER_HANDLER])
    return {
        "workers": n,
        "verified": verified,
        "start_to_verified_ms": {
            "first_tenth": ms(verify[:tenth]),
            "last_tenth": ms(verify[-tenth:]),
        },
        "inventory_handler_ms": {
            "first_tenth": ms(spent[INVENTORY_HANDLER][:tenth]),
            "last_tenth": ms(spent[INVENTORY_HANDLER][-tenth:]),
        },
        "handler_calls": len(calls),
        "own_work_us_per_worker": {
            "first_tenth": round(statistics.median(own_per_worker[:tenth]) * 1e6, 1),
            "last_tenth": round(statistics.median(own_per_worker[-tenth:]) * 1e6, 1),
        },
        "per_worker_ms": [round(v * 1e3, 2) for v in verify],
    }


def many_workers(n: int) -> dict[str, Any]:
    """``n`` workers with verified GPUs: 16 simulated GPUs split into 7 MIG devices each
    give up to 112 devices, one owner each."""
    from accelsched.testing import fake_gpus

    gpus = -(-n // 7)
    with fake_gpus(count=gpus, memory="80GiB", mig=["1g.10gb"] * 7) as fake:
        uuids = [u for d in range(gpus) for u in fake.mig_uuids(d)]
        return asyncio.run(_register_workers(n, uuids))
