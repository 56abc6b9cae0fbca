"""Did a task that asked for no GPU use one? Decisions only, no distributed import.

The guard reads this process's device memory before and after such a task (only when it
ran alone, see :mod:`accelsched.worker.watch`) and asks :func:`classify` what the two
readings mean. Only this process's own figures count: a device-wide figure grows with
other processes too, and blaming a task for them would be wrong.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from accelsched.devices.nvml import MemoryReading

__all__ = ["Use", "classify"]


@dataclass(frozen=True)
class Use:
    """GPU use found on one device: memory growth and/or a new CUDA context."""

    device: int
    nbytes: int  # growth of this process's device memory (0 when it only made a context)
    context_created: bool


def classify(before: Mapping[int, MemoryReading], after: Mapping[int, MemoryReading]) -> list[Use]:
    """The devices an unannotated task used, from readings taken around it."""
    found: list[Use] = []
    for device, now in after.items():
        then = before.get(device)
        if then is None or not (now.exact and then.exact):
            continue  # not this process's own figure: another process may have grown
        grew = now.nbytes - then.nbytes
        created = bool(now.has_context) and then.has_context is False
        if grew > 0 or created:
            found.append(Use(device, max(grew, 0), created))
    return found
