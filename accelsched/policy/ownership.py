"""Who owns which GPU: decisions only, no distributed import.

The worker side decides which of its visible devices it owns and what GPU count to
advertise; the scheduler side grants one owner per GPU UUID so two workers never drive
the same device unless sharing is configured (:func:`grant`; who owns what is the
scheduler's grants, :class:`accelsched.scheduler.grants.Grants`, kept there alone). The
plugins feed these functions facts and carry out what they return.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

__all__ = [
    "owned",
    "Claim",
    "decide_claim",
    "valid_declaration",
    "declared_count",
    "grant",
]

T = TypeVar("T")


def owned(visible: Sequence[T], *, under_dask_cuda: bool) -> list[T]:
    """The devices a worker owns among those it can see.

    A plain worker owns every device in its ``CUDA_VISIBLE_DEVICES``. dask-cuda starts
    one worker per GPU and gives each all GPUs in rotated order ("1,0", "0,1"), so there
    a worker owns exactly its first visible device. A MIG device is a device here: the
    monitor already cut the list to what CUDA enumerates (one MIG device per process).
    """
    return list(visible[:1]) if under_dask_cuda else list(visible)


@dataclass(frozen=True)
class Claim:
    """The GPU count a worker asks the scheduler for, and why it differs from its
    declaration. (What the scheduler grants may be less: see :func:`grant`.)"""

    count: int
    reason: str | None  # None: the declaration was right


def valid_declaration(declared: object) -> bool:
    """A declared GPU count distributed can place against: a finite number >= 0."""
    return (
        isinstance(declared, (int, float))
        and not isinstance(declared, bool)
        and math.isfinite(declared)
        and declared >= 0
    )


def declared_count(declared: object) -> float | None:
    """The declaration as a count for the scheduler's events; None when it is none."""
    return declared if isinstance(declared, (int, float)) and valid_declaration(declared) else None


def decide_claim(declared: object, owned_count: int, *, advertise_undeclared: bool) -> Claim:
    """GPU count a worker should ask for, given what it declared and what it owns.

    A declaration that is no count at all (``"two"``, NaN, -1) claims nothing; the reason
    names it, so the scheduler's ``gpu-corrected`` event says why.
    """
    if declared is not None and not valid_declaration(declared):
        return Claim(0, f"invalid-declaration: {declared!r}")
    assert declared is None or isinstance(declared, (int, float))
    if declared is None or declared == 0:
        if owned_count and advertise_undeclared:
            return Claim(owned_count, "advertised")
        return Claim(0, None)
    if owned_count == 0:
        return Claim(0, "no-devices")
    if declared > owned_count:
        return Claim(owned_count, "fewer-devices")
    if declared < owned_count:
        # The user asked for fewer GPUs than the worker sees: honour the declaration.
        return Claim(int(declared), None)
    return Claim(owned_count, None)


def grant(
    wanted: Sequence[str], owners: Mapping[str, str], *, share: bool
) -> tuple[list[str], dict[str, str]]:
    """The UUIDs of ``wanted`` a worker may drive, given the other workers' (``owners``:
    UUID -> worker), and the refused ones with their owners: one owner per GPU UUID
    unless ``share``.

    A MIG device is owned by its own ``MIG-`` UUID: two MIG devices of one GPU have two
    owners, and one MIG device named two ways (its UUID, its parent's index) has one.
    """
    refused = {} if share else {uuid: owners[uuid] for uuid in wanted if uuid in owners}
    return [uuid for uuid in wanted if uuid not in refused], refused
