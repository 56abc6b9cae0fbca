"""The GPU task every leak-handling policy runs, importable by the worker processes.

A task takes working memory on its (simulated) GPU, "computes" for a fixed time and
returns its index with the worker's pid. One task in ``leak_every`` also leaks a fixed
amount, as a forgotten CuPy array would. Each finished run appends its index to a log
file, so a result that was lost and recomputed shows as a second line.
"""

from __future__ import annotations

import os
import time

import accelsched
from accelsched.testing import device_alloc


def leaks(i: int, leak_every: int) -> bool:
    """Whether task ``i`` leaks: one in each block of ``leak_every``, mid-way through it.

    The position alternates between even and odd from block to block: two workers often
    take tasks in turn, and every leak landing on one of them would measure nothing.
    """
    return leak_every > 0 and i % leak_every == leak_every // 2 + (i // leak_every) % 2


def gpu_task(
    i: int, leak_every: int, leak: int, temp: int, seconds: float, log: str
) -> tuple[int, int]:
    """Use ``temp`` bytes of device memory for ``seconds``; leak ``leak`` bytes if chosen.

    Without accelsched no device is bound to the task, so it uses CUDA device 0: each
    worker's CUDA_VISIBLE_DEVICES names its own GPU, as with dask-cuda.
    """
    device = accelsched.current_device()
    device = 0 if device is None else device
    work = device_alloc(temp, device=device)  # back to the pool's cache when freed
    if leaks(i, leak_every):
        device_alloc(leak, leak=True, device=device)
    time.sleep(seconds)
    work.free()
    with open(log, "a") as f:
        f.write(f"{i}\n")
    return i, os.getpid()


class OpaqueFrame:
    """A cudf-like result: device memory inside an object of a type accelsched can't size.

    Nothing registers it with ``device_nbytes`` and its module is no known GPU library,
    so only measurement around the task that made it can tell it is a result, not a leak.
    """

    def __init__(self, nbytes: int, rows: int) -> None:
        self._column = device_alloc(nbytes)
        self.rows = rows


@accelsched.gpu
def leaky(nbytes: int) -> int:
    """A step that leaks ``nbytes`` (a forgotten CuPy array) besides its temporaries."""
    device_alloc(64 * 2**20)
    device_alloc(nbytes, leak=True)
    return nbytes


@accelsched.gpu
def clean(i: int) -> int:
    """A step that only uses temporaries, given back to the pool."""
    device_alloc(64 * 2**20)
    return i


def big_result(i: int) -> object:
    return device_alloc(2**30, value=i)


def cached_temporaries(i: int) -> int:
    for _ in range(4):
        device_alloc(2**30)
    return i


def rmm_style(i: int) -> int:
    from accelsched.testing import fixed_pool

    fixed_pool(4 * 2**30)
    return device_alloc(2**30).nbytes


def small_results(i: int) -> object:
    return device_alloc(8 * 2**20, value=i)


def opaque_result(i: int) -> OpaqueFrame:
    return OpaqueFrame(2**30, rows=i)
