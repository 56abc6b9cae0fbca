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
    withdrawn as unhealthy), and which (:class:`OfferRequest`). The scheduler places
    against the smaller of this and the grant, and offers declared-memory tasks the
    capacity of the devices named; ``set_resources`` calls cannot change it.
``accelsched_restart`` (:data:`RESTART_HANDLER`)
    A guard asks for its own worker to be restarted (:class:`RestartRequest`); the reply
    (:class:`RestartReply`) says whether the restart was accepted.
``accelsched_status`` (:data:`STATUS_HANDLER`)
    Read-only, for anyone (``accelsched status``): the cluster's GPU state
    (:class:`StatusReply`). A scheduler without accelsched answers ``None``.
``accelsched_demand`` (:data:`DEMAND_HANDLER`)
    Read-only, for :func:`accelsched.adapt`: the GPU work by class, the CPU work and the
    workers, busy or not (:class:`DemandReply`).
``accelsched_pools`` (:data:`POOLS_HANDLER`)
    :func:`accelsched.adapt` says which waiting classes a starting worker will serve, and
    until when, and which wait on pools at their maximum (:class:`PoolsRequest`): a GPU
    task's fallback timeout counts from when no worker that could serve it is coming; and
    the pools' names, so ``accelsched status`` shows each worker's pool.

Scheduler metadata under the PlacementPlugin's name (:data:`PLACEMENT_METADATA`): true
while a PlacementPlugin serves the handlers above (said again after ``client.restart()``,
which clears the scheduler's metadata with its tasks, and when a task of that name is
forgotten, whose metadata distributed drops with it). A scheduler without one answers a
request to them ``None``, but logs it with a traceback; so ``accelsched.adapt`` (at
each look), ``accelsched status`` and a guard (at each report) ask distributed's own
``get_metadata`` handler first (:func:`placement_served`), which such a scheduler
answers quietly. A guard whose report was not answered, or not sent, sends no offer and
no restart request until its next report is answered.

Worker heartbeat metric ``"accelsched"`` (:data:`GUARD_METRIC`): every heartbeat carries
a guard's per-device figures only the worker knows (:class:`GuardMetric`), through
distributed's own custom worker metrics; they arrive in the scheduler's ``WorkerState``.

Worker handlers (``await scheduler.rpc(addr).<name>(...)``):

``accelsched_report`` (:data:`REPORT_HANDLER`)
    The scheduler asks a guard to report its inventory again (a new PlacementPlugin, or a
    GPU whose owner left); the reply is :class:`ReportReply`.
``accelsched_drain`` (:data:`DRAIN_HANDLER`)
    The scheduler restarts this worker (``on=True``) or gave the restart up
    (``on=False``): while on, GPU tasks that reach execution go back to the scheduler
    (distributed's ``Reschedule``) instead of running, so the worker's queue is placed
    elsewhere and the restart waits only for what already runs. The order names the
    ``process`` it is meant for; another process at that address ignores it.

Every request from a worker names the worker address it speaks for, the ``process`` that
sent it (``Worker.id``, the scheduler's ``WorkerState.server_id``) and a ``request`` id
that process never uses twice: a stale request (from a process since replaced) or a
replayed one is refused (:mod:`accelsched.policy.requests`). Nothing is authenticated:
anyone connected is trusted, as in distributed (docs/architecture.md).
"""

from typing import Any, Final, Literal

# typing's own from Python 3.11; its TypedDict knows NotRequired (the optional keys
# readers and validators see: ``__optional_keys__``, ``get_type_hints``) on 3.10 too
from typing_extensions import NotRequired, TypedDict

__all__ = [
    "GPU",
    "GPU_MEMORY",
    "INT_LIMIT",
    "REQUIREMENT_ANNOTATION",
    "PLACEMENT_PLUGIN",
    "GUARD_PLUGIN",
    "FAST_RESTART_PLUGIN",
    "INVENTORY_HANDLER",
    "RESTART_HANDLER",
    "OFFER_HANDLER",
    "REPORT_HANDLER",
    "DRAIN_HANDLER",
    "STATUS_HANDLER",
    "DEMAND_HANDLER",
    "POOLS_HANDLER",
    "PLACEMENT_METADATA",
    "placement_served",
    "ClassDemand",
    "WorkerDemand",
    "DemandReply",
    "PoolsRequest",
    "GUARD_METRIC",
    "TIMEOUT_ANNOTATION",
    "FALLBACK_ANNOTATION",
    "INVALID_RESOURCE",
    "DeviceRecord",
    "report_problem",
    "Addressed",
    "InventoryRequest",
    "InventoryReply",
    "RestartRequest",
    "OfferRequest",
    "OfferReply",
    "RestartReply",
    "RestartStatus",
    "ReportReply",
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

#: Every integer a message carries is under this: distributed's messages carry 64-bit
#: integers (msgpack), and a larger one in a heartbeat or an event closes the worker or
#: the connection that sends it. Counts and byte figures an option takes are held to it.
INT_LIMIT: Final = 2**63

#: Plugin names: ``client.register_plugin`` registers under them, so re-registering
#: replaces rather than stacks, and each side can tell whether the other is installed.
PLACEMENT_PLUGIN: Final = "accelsched-placement"
GUARD_PLUGIN: Final = "accelsched-guard"
FAST_RESTART_PLUGIN: Final = "accelsched-fast-restart"  # a nanny plugin

INVENTORY_HANDLER: Final = "accelsched_inventory"
RESTART_HANDLER: Final = "accelsched_restart"
OFFER_HANDLER: Final = "accelsched_offer"
REPORT_HANDLER: Final = "accelsched_report"
DRAIN_HANDLER: Final = "accelsched_drain"
STATUS_HANDLER: Final = "accelsched_status"
DEMAND_HANDLER: Final = "accelsched_demand"
POOLS_HANDLER: Final = "accelsched_pools"
#: Scheduler metadata key (``Client.get_metadata``): true while a PlacementPlugin serves
#: the scheduler handlers above, false once the last one was unregistered. (distributed
#: keeps a task's metadata under its key too, and drops it with the task: the plugin says
#: it again when a task of this name is forgotten.) Readers take a scheduler that does
#: not say it for one without accelsched: the scheduler, its workers and the clients that
#: use accelsched run the same release.
PLACEMENT_METADATA: Final = PLACEMENT_PLUGIN


async def placement_served(scheduler: Any) -> bool | None:
    """Whether the scheduler behind ``scheduler`` (an rpc to it) runs a PlacementPlugin now,
    by its metadata; None when it could not be asked. Asked through distributed's own
    handler: one the scheduler lacks would be logged there with a traceback."""
    try:
        served = await scheduler.get_metadata(keys=[PLACEMENT_METADATA], default=False)
    except Exception:
        return None
    return served is True


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


class DeviceRecord(_DeviceBasics):
    """One device a guard reports (``index``: its CUDA index in that worker); without
    ``capability`` (``[major, minor]``) and ``mig``: unknown, and a whole GPU."""

    capability: NotRequired[list[int] | None]
    mig: NotRequired[bool]


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


class Addressed(TypedDict):
    """What every request from a worker starts with: the worker address it speaks for,
    the process that sent it (``Worker.id``) and an id that process uses once."""

    worker: str
    process: str
    request: str


class InventoryRequest(Addressed):
    """A guard's report: the devices it owns and how many it asks to advertise.

    ``declared`` is the worker's own ``GPU`` resource (None when it declared none);
    ``requested`` how many of ``devices`` (in order) it asks for; ``reason`` why that
    differs from ``declared`` (see :func:`accelsched.policy.requests.decide_claim`).
    """

    devices: list[DeviceRecord]
    declared: float | None
    requested: int
    reason: str | None


class InventoryReply(TypedDict):
    """``OK`` with the granted ``uuids``; otherwise why not (``refused``: stale or
    replayed, or a device record that is no device). ``draining``: the worker is
    quarantined, so its guard sends GPU tasks back as they reach execution (a guard
    registered again on it learns it here, as its predecessor was told by a drain order)."""

    status: Literal["OK", "no-plugin", "unknown-worker", "refused"]
    uuids: NotRequired[list[str]]
    draining: NotRequired[bool]


class OfferRequest(Addressed):
    """A guard offers ``count`` of its granted GPUs: those of ``uuids``; ``held``: bytes
    the results in its memory hold on each (UUID), in steps (``held_counted``);
    ``packs``: bytes its tasks and results may take on each as it stands (the share it
    packs within, or more while tasks packed under a larger one run)."""

    count: int
    uuids: list[str]
    held: dict[str, int]
    packs: NotRequired[dict[str, int]]


class OfferReply(TypedDict):
    """``OK`` with the ``count`` placement uses now; else why not (``count`` 0). With
    ``OK``: ``shares``, the bytes its declared tasks may take on each offered device
    (UUID; a device several workers share is divided among them), and ``memory``, the
    ``GPU-memory`` (MiB) placed against: the shares less what results hold."""

    status: Literal["OK", "no-plugin", "unknown-worker", "refused", "invalid"]
    count: int
    shares: NotRequired[dict[str, int]]
    memory: NotRequired[int]


class RestartRequest(Addressed):
    """A guard asks for its worker's lossless restart."""

    reason: str
    nbytes: int


RestartStatus = Literal["accepted", "refused", "deferred", "in-flight", "no-plugin"]


class RestartReply(TypedDict):
    """``accepted`` (under way), ``in-flight`` (already under way), ``deferred`` (cannot
    happen without loss now: ``reason``), ``refused`` (stale or replayed), ``no-plugin``."""

    status: RestartStatus
    reason: NotRequired[str]


class ReportReply(TypedDict):
    """``OK`` with the CUDA indices the worker now advertises; else the scheduler's status."""

    status: str
    devices: NotRequired[list[int]]


class ClassDemand(TypedDict):
    """GPU tasks of one class (requirement, devices each), as ``accelsched_demand`` says."""

    name: str  # the class: "<devices>x <requirement label>", e.g. "1x any"
    requirement: dict[str, Any]  # the normalised requirement (memory, model, capability, mig)
    devices: int
    waiting: int  # unrunnable: no worker can take them now
    running: int  # processing on a worker
    seconds: float  # their expected run time, summed


class WorkerDemand(TypedDict):
    name: str
    address: str
    busy: bool  # has tasks processing
    gpu_busy: bool  # has GPU tasks processing
    gpus: int  # devices granted (verified through NVML)
    retiring: bool  # retired, still running (closing gracefully): takes no new task (a
    # worker accelsched drains for a restart is not: it comes back)
    running: bool  # in service: takes tasks, and a retiring peer's results
    holds: bool  # holds results (retiring it moves them to a peer first)


class DemandReply(TypedDict):
    status: Literal["OK"]
    gpu: list[ClassDemand]
    cpu_tasks: int  # tasks without a GPU restriction, ready or running
    cpu_seconds: float
    workers: list[WorkerDemand]


class PoolsRequest(TypedDict):
    """What ``accelsched.adapt`` says of the waiting classes."""

    coming: dict[str, float]  # class -> seconds a worker that serves it may still take
    full: dict[str, list[str]]  # class -> pools at their maximum that could serve it
    bound: float  # at most this long past becoming unrunnable does a coming worker count
    pools: list[str]  # the pools' names: worker ``<pool>-<n>`` is shown in its pool


# --- what ``accelsched status``, the dashboard page and the guards' heartbeats carry: the
# figures a guard sends with each heartbeat (GuardMetric) and the read-only status reply
# the scheduler builds from them (StatusReply)


class DeviceFigures(TypedDict):
    """What a guard alone knows about one granted device, at its last heartbeat.

    ``leases``: GPU tasks holding it now; ``leak_estimate``: bytes the last leak check
    that judged it could not explain (None until one did: the check skips a device while
    a GPU task runs on it); ``leak_threshold``: the bytes a leak must exceed there;
    ``declared``: bytes the tasks holding it declared (absent from older guards).
    """

    index: int
    leases: int
    withdrawn: bool
    leak_estimate: int | None
    leak_threshold: int
    declared: NotRequired[int]


class GuardMetric(TypedDict):
    """The ``"accelsched"`` heartbeat metric: one entry per granted device."""

    devices: list[DeviceFigures]


class DeviceStatus(_DeviceBasics):
    """A verified GPU of a worker (the grant) with the guard's latest figures (None
    while unknown). ``figures`` says why they are unknown, so that a reader can tell a
    worker that has not spoken since the grant (``"waiting"``: no heartbeat has carried
    this device's figures yet) from one whose figures were malformed and left out
    (``"unreadable"``); ``"reported"`` otherwise."""

    capability: str | None  # "9.0"; None: NVML did not say
    declared: int | None  # bytes declared by the tasks holding it now
    figures: Literal["reported", "waiting", "unreadable"]
    leases: int | None
    withdrawn: bool
    leak_estimate: int | None
    leak_threshold: int | None


class _Counted(TypedDict):
    """Events counted: ``restarts``, ``leaks``, ``reclaims`` (``leak-reclaimed``),
    ``fallbacks``."""

    restarts: int
    leaks: int
    reclaims: int
    fallbacks: int


class WorkerStatus(_Counted):
    """One worker, by name. ``gpus``: the count placement uses now; ``declared``: what it
    registered with (None: no GPU declared); ``quarantined``: the reason, or None.
    ``restarts``, ``leaks``, ``reclaims``, ``fallbacks``: events naming this worker (by
    name, so a restarted worker keeps its count); ``reclaims`` counts ``leak-reclaimed``,
    suspected leaks that a garbage collection and a pool free gave back (no restart).
    ``pool``: the elastic pool it belongs to (``accelsched.adapt`` names its workers
    ``<pool>-<n>``), None outside any; absent from an earlier accelsched."""

    name: str
    address: str
    gpus: float
    declared: float | None
    quarantined: str | None
    devices: list[DeviceStatus]
    pool: NotRequired[str | None]


class StatusReply(_Counted):
    """``accelsched status --json`` prints exactly this (``version`` changes only when a
    field changes meaning or goes away). ``fallbacks``: every fallback event, those naming
    no worker (a task unplaced past its timeout) included; ``names``: address -> worker
    name for every worker seen (restarted workers' old addresses included), for events;
    ``options``: the PlacementPlugin's options in effect, durations in seconds (absent
    from an earlier accelsched)."""

    version: int
    time: float
    scheduler: str
    guard: bool
    workers: list[WorkerStatus]
    #: GPU tasks no worker has taken for a few seconds, by why (``no-verified-gpu``,
    #: ``too-few-gpus``, ``unmet-requirement``, ``no-eligible-worker``); empty: none.
    waiting: dict[str, int]
    names: dict[str, str]
    options: NotRequired[dict[str, Any]]
