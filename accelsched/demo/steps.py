"""The demo's pipeline steps: they run on the workers and record where they ran."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import dask.array as da
import numpy as np
from distributed import get_worker

import accelsched

__all__ = ["DEMO_TOPIC", "normalise", "square", "leaky_square", "blocks", "pipeline"]

DEMO_TOPIC = "accelsched-demo"
MiB = 2**20
_LEAKED: list[Any] = []  # device arrays the leaky step "forgets" (real-GPU path)


def _record(step: str, block_info: dict | None) -> None:
    try:
        worker = get_worker()
    except ValueError:  # computed locally, for reference
        return
    block = block_info[None]["chunk-location"][0] if block_info else -1
    worker.log_event(
        DEMO_TOPIC,
        {
            "step": step,
            "block": block,
            # the task the step runs in: dask fuses a block's steps into one task, and
            # the scheduler's fallback events name tasks, not steps
            "key": worker.get_current_task(),
            "worker": worker.address,
            "device": accelsched.current_device(),
        },
    )


@accelsched.gpu
def normalise(block: np.ndarray, block_info: dict | None = None) -> np.ndarray:
    """Device-agnostic: numpy on the host, cupy on a real GPU."""
    _record("normalise", block_info)
    _device_scratch(block)
    xp = accelsched.array_module()
    b = xp.asarray(block)
    out = (b - b.mean()) / (b.std() + 1e-9)
    time.sleep(0.05)  # long enough for blocks to overlap on the two devices
    return _to_numpy(out)


@accelsched.gpu
def square(block: np.ndarray, block_info: dict | None = None) -> np.ndarray:
    _record("square", block_info)
    xp = accelsched.array_module()
    time.sleep(0.05)
    return _to_numpy(xp.asarray(block) ** 2)


@accelsched.gpu
def leaky_square(block: np.ndarray, block_info: dict | None = None) -> np.ndarray:
    """Like ``square``, but block 0 leaves 1.5 GiB of device memory behind."""
    if block_info and block_info[None]["chunk-location"][0] == 0:
        if _simulated():
            from accelsched.testing import device_alloc

            device_alloc(1536 * MiB, leak=True)
        else:
            import cupy

            _LEAKED.append(cupy.zeros(1536 * MiB // 8))
    return square(block, block_info)


def _device_scratch(block: np.ndarray) -> None:
    """On simulated GPUs, use device memory as a real step would (a temporary the size of
    the block, back to the pool when the step ends): the process gets its CUDA context."""
    if _simulated() and accelsched.current_device() is not None:
        from accelsched.testing import device_alloc

        device_alloc(block.nbytes)


def _simulated() -> bool:
    import os

    return bool(os.environ.get("ACCELSCHED_FAKE_NVML_DIR"))


def _to_numpy(x: Any) -> np.ndarray:
    return x.get() if hasattr(x, "get") and not isinstance(x, np.ndarray) else x


def blocks(step2: Callable[..., np.ndarray] = square) -> da.Array:
    """Two GPU steps over 8 blocks: marked in code (``@accelsched.gpu``), so they are
    placed on GPUs with dask's default graph optimisation (fusion) and no annotation."""
    x = da.random.default_rng(42).random((2000, 500), chunks=(250, 500))
    return x.map_blocks(normalise, dtype="f8").map_blocks(step2, dtype="f8")


def pipeline(step2: Callable[..., np.ndarray] = square) -> da.Array:
    return blocks(step2).sum(axis=1)
