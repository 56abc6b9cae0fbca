"""What the scheduler side and the worker side of accelsched say to each other.

Every name that crosses a process boundary lives here, and every message and reply has a
type: the PlacementPlugin (scheduler) and the GuardPlugin (workers) import this module
and nothing of each other. Messages travel as plain dicts (distributed's RPC serializes
them with msgpack), so the types are ``TypedDict``\\ s with ``Literal`` statuses; a
checker catches a misspelt status or key on either side.

Scheduler handlers (``await worker.scheduler.<name>(**request)``):

``accelsched_inventory`` (:data:`INVENTORY_HANDLER`)
    A guard reports the devices it verified through NVML and the GPU count it asks for
    (:class:`InventoryRequest`); the reply (:class:`InventoryReply`) lists the UUIDs the
    scheduler granted.
``accelsched_offer`` (:data:`OFFER_HANDLER`)
    A guard says how many of its granted GPUs it offers now (fewer while one is
    withdrawn as unhealthy) (:class:`OfferRequest`). The scheduler places against the
    smaller of this and the grant; ``set_resources`` calls cannot change it.
``accelsched_restart`` (:data:`RESTART_HANDLER`)
    A guard asks for its own worker to be restarted (:class:`RestartRequest`); the reply
    (:class:`RestartReply`) says whether the restart was accepted.
``accelsched_status`` (:data:`STATUS_HANDLER`)
    Read-only, for anyone (``accelsched status``): the cluster's GPU state
    (:class:`StatusReply`). A scheduler without accelsched answers ``None``.

Worker heartbeat metric ``"accelsched"`` (:data:`GUARD_METRIC`): every heartbeat carries
a guard's per-device figures only the worker knows (:class:`GuardMetric`), through
distributed's own custom worker metrics; they arrive in the scheduler's ``WorkerState``.

Worker handlers (``await scheduler.rpc(addr).<name>(...)``):

``accelsched_report`` (:data:`REPORT_HANDLER`)
    The scheduler asks a guard to report its inventory again (a new PlacementPlugin, or a
    GPU whose owner left); the reply is :class:`ReportReply`.
``accelsched_confirm`` (:data:`CONFIRM_HANDLER`)
    Who speaks for a worker: every request above names a worker and carries a one-time
    ``request`` id. Before acting, the scheduler calls the named worker back at the
    address it registered under and asks whether the request is its own, sent to that
    handler with that content (``fingerprint``, :func:`accelsched.policy.requests.fingerprint`;
    :class:`ConfirmReply`). An id confirms once. A client or another worker naming it is
    refused, and nothing secret ever leaves the scheduler or the worker. The scheduler
    serves an ``accelsched_confirm`` of its own for its orders (``accelsched_drain``).
``accelsched_drain`` (:data:`DRAIN_HANDLER`)
    The scheduler restarts this worker (``on=True``) or gave the restart up
    (``on=False``): while on, GPU tasks that reach execution go back to the scheduler
    (distributed's ``Reschedule``) instead of running, so the worker's queue is placed
    elsewhere and the restart waits only for what already runs. The order carries a
    one-time ``request`` id; the guard asks the scheduler back (the scheduler's own
    ``accelsched_confirm``) before it obeys, so only the scheduler can drain a worker.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final, Literal, TypedDict

__all__ = [
    "GPU",
    "GPU_MEMORY",
    "REQUIREMENT_ANNOTATION",
    "PLACEMENT_PLUGIN",
    "GUARD_PLUGIN",
    "FAST_RESTART_PLUGIN",
    "INVENTORY_HANDLER",
    "RESTART_HANDLER",
    "OFFER_HANDLER",
    "REPORT_HANDLER",
    "CONFIRM_HANDLER",
    "DRAIN_HANDLER",
    "EVENT_OP",
    "STATUS_HANDLER",
    "GUARD_METRIC",
    "TIMEOUT_ANNOTATION",
    "FALLBACK_ANNOTATION",
    "INVALID_RESOURCE",
    "DeviceRecord",
    "report_problem",
    "InventoryRequest",
    "InventoryReply",
    "RestartRequest",
    "OfferRequest",
    "OfferReply",
    "RestartReply",
    "RestartStatus",
    "ReportReply",
    "ConfirmReply",
    "EventMessage",
    "request_content",
    "DeviceFigures",
    "GuardMetric",
    "DeviceStatus",
    "WorkerStatus",
    "StatusReply",
]

#: The resource name GPU tasks ask for (``dask.annotate(resources={"GPU": 1})``).
GPU: Final = "GPU"
#: Device memory, in MiB, that tasks declaring memory take of a worker (its devices'
#: capacity summed); the worker's lease table packs them per device.
GPU_MEMORY: Final = "GPU-memory"
#: Task annotation: what the task's device must be (``{"memory": "24GiB", ...}``,
#: :mod:`accelsched.policy.requirements`). The scheduler writes it back normalised (bytes,
#: ``[major, minor]``), for marked steps too; the worker binds by it.
REQUIREMENT_ANNOTATION: Final = "gpu"

#: Plugin names: ``client.register_plugin`` registers under them, so re-registering
#: replaces rather than stacks, and each side can tell whether the other is installed.
PLACEMENT_PLUGIN: Final = "accelsched-placement"
GUARD_PLUGIN: Final = "accelsched-guard"
FAST_RESTART_PLUGIN: Final = "accelsched-fast-restart"  # a nanny plugin

INVENTORY_HANDLER: Final = "accelsched_inventory"
RESTART_HANDLER: Final = "accelsched_restart"
OFFER_HANDLER: Final = "accelsched_offer"
REPORT_HANDLER: Final = "accelsched_report"
CONFIRM_HANDLER: Final = "accelsched_confirm"
DRAIN_HANDLER: Final = "accelsched_drain"
STATUS_HANDLER: Final = "accelsched_status"
#: A guard's events reach the scheduler on the worker's own stream under this op (never
#: through ``Worker.log_event``, which task code may call with any topic).
EVENT_OP: Final = "accelsched-event"
#: The guard's custom worker metric, sent with every heartbeat (``Worker.metrics``).
GUARD_METRIC: Final = "accelsched"

#: Task annotation overriding the default fallback timeout (``dask.annotate``).
TIMEOUT_ANNOTATION: Final = "fallback_timeout"
#: Annotation the scheduler puts on a task that fell back (value: the reason). The worker
#: reads it to copy the task's device-array inputs to the host.
FALLBACK_ANNOTATION: Final = "accelsched_fallback"
#: An unsatisfiable resource that parks a task with an invalid annotation until it errs.
INVALID_RESOURCE: Final = "accelsched-invalid-annotation"


class _DeviceBasics(TypedDict):
    index: int
    uuid: str
    name: str
    memory: int


class DeviceRecord(_DeviceBasics, total=False):
    """One device a guard reports (``index``: its CUDA index in that worker); without
    ``capability`` (``[major, minor]``) and ``mig``: unknown, and a whole GPU."""

    capability: list[int] | None
    mig: bool


def report_problem(devices: Any, requested: Any) -> str | None:
    """Why a guard's device report cannot be granted as it is, or None. Requirements,
    ``GPU-memory`` and status read these fields as the types :class:`DeviceRecord` says."""
    if (
        not isinstance(devices, (list, tuple))
        or not isinstance(requested, int)
        or isinstance(requested, bool)
    ):
        return f"devices={devices!r:.80} requested={requested!r:.20}: expected a list and a count"
    for record in devices:
        if not isinstance(record, dict):
            return f"device record {record!r:.80}: expected a mapping"
        for field, kind in (("index", int), ("uuid", str), ("name", str), ("memory", int)):
            value = record.get(field)
            if not isinstance(value, kind) or isinstance(value, bool):
                return f"device record {field}={value!r:.80}: expected {kind.__name__}"
        if record["memory"] < 0:
            return f"device record memory={record['memory']!r}: expected bytes"
    return None


class InventoryRequest(TypedDict):
    """A guard's report: the devices it owns and how many it asks to advertise.

    ``declared`` is the worker's own ``GPU`` resource (None when it declared none);
    ``requested`` how many of ``devices`` (in order) it asks for; ``reason`` why that
    differs from ``declared`` (see :func:`accelsched.policy.ownership.decide_claim`);
    ``request`` the one-time id the worker confirms when called back.
    """

    worker: str
    request: str
    devices: list[DeviceRecord]
    declared: float | None
    requested: int
    reason: str | None


class _InventoryReplyBase(TypedDict):
    status: Literal["OK", "no-plugin", "unknown-worker", "refused"]


class InventoryReply(_InventoryReplyBase, total=False):
    """``OK`` with the granted ``uuids``; otherwise why not (``refused``: the named worker
    did not confirm the request). ``token``: the worker's own, for its events
    (:class:`EventMessage`); only the scheduler and that worker's process know it."""

    uuids: list[str]
    token: str


class EventMessage(TypedDict):
    """A guard's event (:data:`EVENT_OP`, on its worker's stream). ``token`` is the one
    its inventory reply gave it: the event is logged in the name of the worker it belongs
    to, whatever else the message says (a stream message can name any worker)."""

    msg: dict[str, Any]
    token: str


class OfferRequest(TypedDict):
    """A guard offers ``count`` of its granted GPUs; the worker confirms ``request``."""

    worker: str
    request: str
    count: int


class OfferReply(TypedDict):
    """``OK`` with the ``count`` placement uses now; else why not (``count`` 0)."""

    status: Literal["OK", "no-plugin", "unknown-worker", "refused", "invalid"]
    count: int


class RestartRequest(TypedDict):
    """A guard asks for its worker's lossless restart; the worker confirms ``request``."""

    worker: str
    request: str
    reason: str
    nbytes: int


RestartStatus = Literal["accepted", "refused", "deferred", "in-flight", "no-plugin"]


class _RestartReplyBase(TypedDict):
    status: RestartStatus


class RestartReply(_RestartReplyBase, total=False):
    """``accepted`` (under way), ``in-flight`` (already under way), ``deferred`` (cannot
    happen without loss now: ``reason``), ``refused`` (not that worker), ``no-plugin``."""

    reason: str


class _ReportReplyBase(TypedDict):
    status: str


class ReportReply(_ReportReplyBase, total=False):
    """``OK`` with the CUDA indices the worker now advertises; else the scheduler's status."""

    devices: list[int]


class ConfirmReply(TypedDict):
    """Whether the named worker has ``request`` outstanding: it asked, nobody else."""

    confirmed: bool


#: Fields of a request that identify it, not what it says: left out of its fingerprint.
_ADDRESSING = ("worker", "request")


def request_content(request: Mapping[str, Any]) -> dict[str, Any]:
    """What a request says (its fingerprint's content): all but whom and which id."""
    return {k: v for k, v in request.items() if k not in _ADDRESSING}


# what the status and the heartbeat metric carry: their own module, re-exported here
from accelsched.status_protocol import (  # noqa: E402
    DeviceFigures,
    DeviceStatus,
    GuardMetric,
    StatusReply,
    WorkerStatus,
)
