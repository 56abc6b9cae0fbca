"""What ``accelsched status``, the dashboard page and the guards' heartbeats carry.

Part of the protocol (:mod:`accelsched.protocol` re-exports every name): the figures a
guard sends with each heartbeat (:class:`GuardMetric`) and the read-only status reply
the scheduler builds from them (:class:`StatusReply`). Plain types, no imports of
either side.
"""

from __future__ import annotations

from typing import Any, Literal, TypedDict

__all__ = ["DeviceFigures", "GuardMetric", "DeviceStatus", "WorkerStatus", "StatusReply"]


class _DeviceFiguresBase(TypedDict):
    """What a guard alone knows about one granted device, at its last heartbeat.

    ``leases``: GPU tasks holding it now; ``leak_estimate``: bytes the last leak check
    that judged it could not explain (None until one did: the check skips a device while
    a GPU task runs on it); ``leak_threshold``: the bytes a leak must exceed there.
    """

    index: int
    leases: int
    withdrawn: bool
    leak_estimate: int | None
    leak_threshold: int


class DeviceFigures(_DeviceFiguresBase, total=False):
    """What a guard alone knows about one granted device (see the base's fields);
    ``declared``: bytes the tasks holding it declared (absent from older guards)."""

    declared: int


class GuardMetric(TypedDict):
    """The ``"accelsched"`` heartbeat metric: one entry per granted device."""

    devices: list[DeviceFigures]


class DeviceStatus(TypedDict):
    """A verified GPU of a worker (the grant) with the guard's latest figures (None
    while unknown). ``figures`` says why they are unknown, so that a reader can tell a
    worker that has not spoken since the grant (``"waiting"``: no heartbeat has carried
    this device's figures yet) from one whose figures were malformed and left out
    (``"unreadable"``); ``"reported"`` otherwise."""

    index: int
    uuid: str
    name: str
    memory: int
    capability: str | None  # "9.0"; None: NVML did not say
    declared: int | None  # bytes declared by the tasks holding it now
    figures: Literal["reported", "waiting", "unreadable"]
    leases: int | None
    withdrawn: bool
    leak_estimate: int | None
    leak_threshold: int | None


class _WorkerStatusBase(TypedDict):
    """One worker, by name. ``gpus``: the count placement uses now; ``declared``: what it
    registered with (None: no GPU declared); ``quarantined``: the reason, or None.
    ``restarts``, ``leaks``, ``reclaims``, ``fallbacks``: events naming this worker (by
    name, so a restarted worker keeps its count); ``reclaims`` counts ``leak-reclaimed``,
    suspected leaks that a garbage collection and a pool free gave back (no restart)."""

    name: str
    address: str
    gpus: float
    declared: float | None
    quarantined: str | None
    devices: list[DeviceStatus]
    restarts: int
    leaks: int
    reclaims: int
    fallbacks: int


class WorkerStatus(_WorkerStatusBase, total=False):
    """One worker (see the base's fields); ``pool``: the elastic pool it belongs to
    (``accelsched.adapt`` names its workers ``<pool>-<n>``), None outside any; absent from
    an earlier accelsched."""

    pool: str | None


class _StatusReplyBase(TypedDict):
    """``accelsched status --json`` prints exactly this (``version`` changes only when a
    field changes meaning or goes away). ``fallbacks``: every fallback event, those naming
    no worker (a task unplaced past its timeout) included; ``names``: address -> worker
    name for every worker seen (restarted workers' old addresses included), for events."""

    version: int
    time: float
    scheduler: str
    guard: bool
    workers: list[WorkerStatus]
    restarts: int
    leaks: int
    reclaims: int
    fallbacks: int
    #: GPU tasks no worker has taken for a few seconds, by why (``no-verified-gpu``,
    #: ``too-few-gpus``, ``unmet-requirement``, ``no-eligible-worker``); empty: none.
    waiting: dict[str, int]
    names: dict[str, str]


class StatusReply(_StatusReplyBase, total=False):
    """The status reply (see the base's fields); ``options``: the PlacementPlugin's
    options in effect, durations in seconds (absent from an earlier accelsched)."""

    options: dict[str, Any]
