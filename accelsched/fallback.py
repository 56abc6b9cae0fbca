"""When a GPU task stops waiting for a GPU: decisions only, no distributed import.

A GPU task that no worker can take sits in distributed's ``no-worker`` state forever.
With a fallback timeout it runs its CPU form instead. The PlacementPlugin feeds
:class:`FallbackPolicy` each unrunnable GPU task's wait and the cluster's GPU capacity;
the policy answers with the reason to fall back, or None to keep waiting.
"""

from __future__ import annotations

from typing import Any

from accelsched.config import parse_optional_duration

__all__ = ["FallbackPolicy", "TIMEOUT", "NO_GPU_CAPACITY", "CHAIN", "OOM", "parse_task_timeout"]

TIMEOUT = "timeout"  # the task's own timeout expired
NO_GPU_CAPACITY = "no-gpu-capacity"  # timeout 0: no GPU worker can take it now
CHAIN = "chain"  # a GPU predecessor fell back and there is still no GPU capacity
OOM = "oom"  # the GPU form ran out of device memory (decided on the worker)

_UNSET: Any = object()


def parse_task_timeout(value: Any) -> float | None:
    """Parse a ``fallback_timeout`` task annotation; ValueError names the bad value."""
    try:
        return parse_optional_duration("fallback_timeout annotation", value)
    except TypeError as exc:
        raise ValueError(str(exc)) from None


class FallbackPolicy:
    """Decides, per unrunnable GPU task, whether to run its CPU form now.

    ``default`` is the plugin-wide timeout in seconds (None: strict, never fall back).
    """

    def __init__(self, default: float | None) -> None:
        self.default = default

    def timeout(self, annotated: float | None | Any = _UNSET) -> float | None:
        """The timeout a task lives by: its annotation when it has one, else the default."""
        return self.default if annotated is _UNSET else annotated

    def decide(
        self,
        *,
        waited: float,
        timeout: float | None,
        predecessor_fell_back: bool,
        gpu_capacity: bool,
    ) -> str | None:
        """Reason to fall back now, or None to keep waiting.

        ``waited``: seconds the task has been unrunnable. ``gpu_capacity``: whether any
        worker in the cluster has enough verified GPUs for it right now.
        """
        if timeout is None:
            return None
        if predecessor_fell_back and not gpu_capacity:
            return CHAIN
        if timeout == 0:
            return NO_GPU_CAPACITY
        if waited >= timeout:
            return TIMEOUT
        return None
