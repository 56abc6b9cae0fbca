"""Which workers may run a task with a requirement: those with a verified device meeting it.

A task whose step or annotation says what its device must be (memory, model, compute
capability, MIG; :mod:`accelsched.policy.requirements`) is restricted to the workers
whose granted devices, as NVML verified them, can hold it: as many devices as it takes
that meet it, and for a task that declares memory one whose declarable capacity (less the
reserve) is that large. A ``workers=`` restriction of its own stays: the two meet. A
task that declares memory takes ``GPU-memory`` (MiB) instead of a whole ``GPU``, so tasks
share a device while their needs fit; the worker's lease table packs them per device.
The requirement travels to the worker normalised in the task's ``gpu`` annotation; an
annotated requirement and those of the marked steps the task calls combine.

When a worker's devices are granted, every waiting task it can serve gains it; a
requirement no verified device in the cluster meets is said once (``unmet-requirement``)
and its tasks wait, or run their CPU form after their timeout, as any unplaced GPU task.
A worker that sends such a task back (its device withdrawn: which one, the offer does not
say) loses it until its devices are granted or offered again, so nothing bounces.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from accelsched import events, internals
from accelsched.policy.leases import devices_needed
from accelsched.policy.marks import Mark, find_mark, mark_problem
from accelsched.policy.requirements import (
    DeviceFacts,
    Requirement,
    capacity,
    combine,
    mebibytes,
    parse_requirement,
)
from accelsched.protocol import GPU, GPU_MEMORY, REQUIREMENT_ANNOTATION, DeviceRecord
from accelsched.scheduler.grants import Grants

if TYPE_CHECKING:
    from distributed import Scheduler

__all__ = ["Eligibility", "facts_of", "memory_capacity", "report_problem"]

#: Task states in which the scheduler has not yet chosen a worker: restrictions count.
_UNPLACED = frozenset({"released", "waiting", "no-worker", "queued"})
#: A worker address no worker has: the restriction of a task no worker can serve yet.
NOWHERE = "accelsched://no-verified-device-meets-the-requirement"
#: How distributed names the stimulus of a task its worker sent back (``Reschedule``).
_SENT_BACK = "reschedule"


def facts_of(record: DeviceRecord) -> DeviceFacts:
    """A granted device as requirements see it (a guard's report, checked types)."""
    cc = record.get("capability")
    capability = (
        (int(cc[0]), int(cc[1]))
        if isinstance(cc, (list, tuple))
        and len(cc) == 2
        and all(_whole(v) and 0 <= v < 1000 for v in cc)
        else None
    )
    return DeviceFacts(
        str(record["name"]), int(record["memory"]), capability, record.get("mig") is True
    )


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def report_problem(devices: Any, requested: Any) -> str | None:
    """Why a guard's device report cannot be granted as it is, or None. Requirements,
    ``GPU-memory`` and status read these fields as the types :class:`DeviceRecord` says."""
    if not isinstance(devices, (list, tuple)) or not _whole(requested):
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


def memory_capacity(records: list[DeviceRecord], count: int) -> int:
    """``GPU-memory`` (MiB) a worker offers: its first ``count`` granted devices'
    capacity (fewer while one is withdrawn: which one the offer does not say)."""
    return sum(mebibytes(capacity(int(d["memory"]))) for d in records[:count])


def holds(need: Requirement, n: int, facts: list[DeviceFacts]) -> bool:
    """Whether devices ``facts`` can ever hold a task needing ``n`` devices meeting ``need``."""
    return sum(need.fits(f) for f in facts) >= n


class Eligibility:
    """Tasks with requirements, by requirement; which workers can serve each."""

    def __init__(self, grants: Grants, *, emit: Callable[..., None]) -> None:
        self.scheduler: Scheduler | None = None
        self._grants = grants
        self._emit = emit
        self._tasks: dict[tuple[str, int], set[Any]] = {}  # (label, devices) -> task keys
        self.keys: dict[Any, tuple[str, int]] = {}  # task key -> its (label, devices)
        self._requirements: dict[str, Requirement] = {}  # label -> requirement
        self._unmet: dict[str, int] = {}  # label -> tasks seen while no device meets it
        self._own: dict[Any, set[str]] = {}  # task key -> its own workers= restriction
        self._sent: dict[Any, str] = {}  # task key -> the worker it was last sent to

    def start(self, scheduler: Scheduler) -> None:
        """Take up the waiting tasks a previous instance restricted (re-registered)."""
        self.scheduler = scheduler
        for ts in list(scheduler.tasks.values()):
            restrictions = ts.resource_restrictions or {}
            gpu = GPU in restrictions or GPU_MEMORY in restrictions
            if gpu and ts.state in _UNPLACED and (ts.annotations or {}).get(REQUIREMENT_ANNOTATION):
                internals.restrict_to_workers(ts, None)  # its own: unknown now
                self.prepare(ts, None, restrictions.get(GPU, 1), say=False)

    def prepare(
        self, ts: Any, mark: Mark | None, count: float, *, say: bool = True, looked: bool = False
    ) -> str | None:
        """Restrict a new GPU task by its requirement; a problem to err it with, or None.

        ``mark``: the marked step the task calls, if known (``looked``: None means it
        calls none; else looked for here: an annotated GPU task may call one too)."""
        given = (ts.annotations or {}).get(REQUIREMENT_ANNOTATION)
        if mark is None and not looked:
            mark = find_mark(internals.task_spec(ts))
            if mark is not None and (problem := mark_problem(mark)) is not None:
                return problem
        step = mark.requirement if mark is not None else None
        if given is None and step is None:
            return None
        try:
            need = parse_requirement(given)
            need = parse_requirement(combine([r for r in (need, step) if r]) or need)
        except ValueError as exc:
            return str(exc)
        if not need:
            return None
        if need.memory is not None and count != 1:
            return f"{need.label()}: a task that declares memory takes one device, not {count}"
        label, n = need.label(), devices_needed(count)
        internals.annotate(ts, REQUIREMENT_ANNOTATION, _normalised(need))
        if need.memory is not None:  # shares a device: memory, not a whole GPU
            restrictions = {k: v for k, v in ts.resource_restrictions.items() if k != GPU}
            restrictions[GPU_MEMORY] = mebibytes(need.memory)
            internals.set_resource_restrictions(ts, restrictions)
            internals.drop_annotated_resource(ts, GPU)
        self._requirements[label] = need
        self._tasks.setdefault((label, n), set()).add(ts.key)
        self.keys[ts.key] = (label, n)
        if own := internals.restricted_to(ts):
            self._own[ts.key] = own
        workers = self.serving(need, n)
        internals.restrict_to_workers(ts, (workers & own if own else workers) or {NOWHERE})
        if not workers:
            first = label not in self._unmet
            self._unmet[label] = self._unmet.get(label, 0) + 1
            if first and say:
                self._emit(events.UNMET_REQUIREMENT, None, requirement=label, key=str(ts.key))
        return None

    def serving(self, need: Requirement, n: int = 1) -> set[str]:
        """Workers with granted (verified) devices that can hold ``n`` tasks' worth of ``need``."""
        return {
            worker
            for worker, records in self._grants.granted_devices().items()
            if holds(need, n, [facts_of(r) for r in records])
        }

    def refresh(self, worker: str) -> None:
        """``worker``'s devices were granted: every unplaced task it can serve gains it."""
        scheduler = self.scheduler
        if scheduler is None:
            return
        records = self._grants.granted_devices().get(worker, [])
        facts = [facts_of(r) for r in records]
        for (label, n), keys in self._tasks.items():
            if not holds(self._requirements[label], n, facts):
                continue
            self._unmet.pop(label, None)
            for key in keys:
                ts = scheduler.tasks.get(key)
                own = self._own.get(key)
                if ts is None or ts.state not in _UNPLACED or (own and worker not in own):
                    continue
                current = internals.restricted_to(ts) - {NOWHERE}
                internals.restrict_to_workers(ts, current | {worker})

    def moved(self, key: Any, start: str, finish: str, stimulus_id: str) -> None:
        """A task with a requirement moved: note where it was sent; one its worker sent
        back (no device there can hold it now) goes elsewhere, or waits."""
        scheduler = self.scheduler
        ts = None if scheduler is None else scheduler.tasks.get(key)
        if scheduler is None or ts is None:
            return
        if finish == "processing":
            if (worker := internals.processing_on(ts)) is not None:
                self._sent[key] = worker
        elif start == "processing" and stimulus_id.startswith(_SENT_BACK):
            worker = self._sent.pop(key, None)
            if worker is not None and internals.in_service(scheduler, worker):  # no drain
                left = internals.restricted_to(ts) - {worker}
                internals.restrict_to_workers(ts, left or {NOWHERE})

    def forget(self, key: Any) -> None:
        """A forgotten task, or one that fell back (its CPU form runs anywhere)."""
        self._sent.pop(key, None)
        self._own.pop(key, None)
        group = self.keys.pop(key, None)
        if group is None:
            return
        keys = self._tasks.get(group, set())
        keys.discard(key)
        if not keys:
            self._tasks.pop(group, None)
            if not any(label == group[0] for label, _ in self._tasks):
                self._requirements.pop(group[0], None)

    def fell_back(self, ts: Any) -> None:
        """The CPU form runs wherever its own restriction allows, with no device memory."""
        if ts.key in self.keys:
            internals.restrict_to_workers(ts, self._own.get(ts.key))
            self.forget(ts.key)

    def unmet(self) -> dict[str, int]:
        """Requirements no verified device meets, and how many tasks asked for each."""
        return dict(self._unmet)


def _normalised(need: Requirement) -> dict[str, Any]:
    """The requirement as the worker reads it back (plain, msgpack-safe values)."""
    return {
        "memory": need.memory,
        "model": need.model,
        "capability": None if need.capability is None else list(need.capability),
        "mig": need.mig,
    }
