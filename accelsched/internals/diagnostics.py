"""distributed's own NVML diagnostics (for :mod:`accelsched.testing`) and SpecCluster.

distributed.diagnostics.nvml remembers "no NVML" for the life of the process, and once
initialized it adds GPU metrics to every worker started in-process.
"""

from __future__ import annotations

import sys
from typing import Any


def distributed_nvml_state() -> tuple[Any, ...] | None:
    nvml: Any = sys.modules.get("distributed.diagnostics.nvml")
    worker: Any = sys.modules.get("distributed.worker")
    if nvml is None:
        return None
    return (
        nvml.NVML_STATE,
        nvml.NVML_OWNER_PID,
        "gpu" in getattr(worker, "DEFAULT_METRICS", {}),
        "gpu" in getattr(worker, "DEFAULT_STARTUP_INFORMATION", {}),
    )


def reset_distributed_nvml() -> None:
    """Make distributed look for NVML again (it found none before fake GPUs existed)."""
    nvml: Any = sys.modules.get("distributed.diagnostics.nvml")
    if nvml is not None and nvml.NVML_STATE == nvml.NVMLState.DISABLED_LIBRARY_NOT_FOUND:
        nvml.NVML_STATE = nvml.NVMLState.UNINITIALIZED


def restore_distributed_nvml(saved: tuple[Any, ...] | None) -> None:
    nvml: Any = sys.modules.get("distributed.diagnostics.nvml")
    if nvml is None:
        return
    if saved is None:  # imported during the session: as if it had never looked
        saved = (nvml.NVMLState.UNINITIALIZED, None, False, False)
    nvml.NVML_STATE, nvml.NVML_OWNER_PID, had_metrics, had_startup = saved
    worker: Any = sys.modules.get("distributed.worker")
    if worker is not None:
        if not had_metrics:
            worker.DEFAULT_METRICS.pop("gpu", None)
        if not had_startup:
            worker.DEFAULT_STARTUP_INFORMATION.pop("gpu", None)


def add_spec_worker(cluster: Any, name: str, spec: dict[str, Any]) -> None:
    """Start one more worker of a running SpecCluster (a LocalCUDACluster, say)."""
    cluster.worker_spec[name] = spec
    cluster.sync(cluster._correct_state)
