"""Host processes of in-process workers, each owning one simulated MIG device.

What :mod:`benchmarks.micro.placement_cost` starts its clusters' workers in: one process
per :data:`PER_HOST` workers, each process with its own simulated devices, so that the
scheduler, in a process of its own, is measured alone.
"""

from __future__ import annotations

import asyncio
import os

#: Workers one host process holds: the simulated NVML library (``fakenvml.c``) knows at
#: most 128 MIG devices in one session, and each worker owns one. Beyond it, workers
#: found no device and were never verified: why 256 workers in one host did not complete.
PER_HOST = 128
MIGS_PER_GPU = 7


#: The worker host's command (``python -c HOST ADDRESS FIRST N GPUS``): workers
#: ``w<FIRST>`` to ``w<FIRST+N-1>``; ``GPUS`` 1: each owns a simulated MIG device, 0: plain.
HOST = (
    "import asyncio, sys\n"
    "from benchmarks.micro.worker_hosts import host\n"
    "host(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == '1')\n"
)


def host(address: str, first: int, n: int, gpus: bool) -> None:
    """``n`` in-process workers until the scheduler closes; with ``gpus``, in this host's
    own simulated devices (at most :data:`PER_HOST` MIG devices: see there)."""
    if not gpus:
        asyncio.run(_host(address, first, ["none"] * n))
        return
    from accelsched.testing import fake_gpus

    whole, rest = divmod(n, MIGS_PER_GPU)
    mig = [["1g.10gb"] * MIGS_PER_GPU] * whole + ([["1g.10gb"] * rest] if rest else [])
    with fake_gpus(count=len(mig), memory="80GiB", mig=mig) as fake:
        uuids = [u for d in range(len(mig)) for u in fake.mig_uuids(d)]
        asyncio.run(_host(address, first, uuids))


async def _host(address: str, first: int, uuids: list[str]) -> None:
    from distributed import Worker

    workers = []
    for i, uuid in enumerate(uuids, first):
        os.environ["CUDA_VISIBLE_DEVICES"] = uuid  # read by the guard's probe
        workers.append(
            await Worker(address, nthreads=1, resources={"GPU": 1}, name=f"w{i}", validate=False)
        )
    await asyncio.gather(*(w.finished() for w in workers))


def split(n: int) -> list[int]:
    """``n`` workers over as few hosts as hold them, evenly: 256 -> [128, 128]."""
    hosts = -(-n // PER_HOST)
    return [n // hosts + (1 if h < n % hosts else 0) for h in range(hosts)]
