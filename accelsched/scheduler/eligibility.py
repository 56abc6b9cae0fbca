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

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from accelsched import events, internals
from accelsched.policy.leases import devices_needed
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

    from accelsched.policy.marks import Mark
    from accelsched.scheduler.fallback import GpuTask

__all__ = ["Eligibility", "UNPLACED", "facts_of", "memory_capacity"]

#: Task states in which the scheduler has not yet chosen a worker: restrictions count.
UNPLACED = frozenset({"released", "waiting", "no-worker", "queued"})
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


def memory_capacity(records: list[DeviceRecord], count: int) -> int:
    """``GPU-memory`` (MiB) a worker offers: its first ``count`` granted devices'
    capacity (fewer while one is withdrawn: which one the offer does not say)."""
    return sum(mebibytes(capacity(int(d["memory"]))) for d in records[:count])


def holds(need: Requirement, n: int, facts: list[DeviceFacts]) -> bool:
    """Whether devices ``facts`` can ever hold a task needing ``n`` devices meeting ``need``."""
    return sum(need.fits(f) for f in facts) >= n


class Eligibility:
    """Restricts GPU tasks with a requirement to the workers that can serve them.

    What it knows of each task is on the task's record (:class:`GpuTask`), which the
    fallback keeps; here only which requirements were said to be unmet.
    """

    def __init__(self, scheduler: Scheduler, grants: Grants, *, emit: Callable[..., None]) -> None:
        self.scheduler = scheduler
        self._grants = grants
        self._emit = emit
        self._unmet: set[str] = set()  # requirements said unmet, until a device meets them

    def prepare(
        self, ts: Any, task: GpuTask, mark: Mark | None, count: float, *, say: bool = True
    ) -> str | None:
        """Restrict a new GPU task by its requirement (its annotated one, and that of the
        marked step it calls); a problem to err it with, or None."""
        given = (ts.annotations or {}).get(REQUIREMENT_ANNOTATION)
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
        internals.annotate(ts, REQUIREMENT_ANNOTATION, _normalised(need))
        if need.memory is not None:  # shares a device: memory, not a whole GPU
            restrictions = {k: v for k, v in ts.resource_restrictions.items() if k != GPU}
            restrictions[GPU_MEMORY] = mebibytes(need.memory)
            internals.set_resource_restrictions(ts, restrictions)
            internals.drop_annotated_resource(ts, GPU)
        task.need, task.devices = need, devices_needed(count)
        task.own = internals.restricted_to(ts) or None
        workers = self.serving(need, task.devices)
        mine = workers & task.own if task.own else workers
        internals.restrict_to_workers(ts, mine or {NOWHERE})
        if not workers and (label := need.label()) not in self._unmet:
            self._unmet.add(label)
            if say:
                self._emit(events.UNMET_REQUIREMENT, None, requirement=label, key=str(ts.key))
        return None

    def serving(self, need: Requirement, n: int = 1) -> set[str]:
        """Workers with granted (verified) devices that can hold ``n`` tasks' worth of ``need``."""
        return {
            worker
            for worker, records in self._grants.granted_devices().items()
            if holds(need, n, [facts_of(r) for r in records])
        }

    def refresh(self, worker: str, tasks: Mapping[Any, GpuTask]) -> None:
        """``worker``'s devices were granted: every unplaced task it can serve gains it."""
        facts = [facts_of(r) for r in self._grants.granted_devices().get(worker, [])]
        for key, task in tasks.items():
            if task.need is None or not holds(task.need, task.devices, facts):
                continue
            self._unmet.discard(task.need.label())
            ts = self.scheduler.tasks.get(key)
            if ts is None or ts.state not in UNPLACED or (task.own and worker not in task.own):
                continue
            current = internals.restricted_to(ts) - {NOWHERE}
            internals.restrict_to_workers(ts, current | {worker})

    def moved(self, ts: Any, task: GpuTask, start: str, finish: str, stimulus_id: str) -> None:
        """A task with a requirement moved: note where it was sent; one its worker sent
        back (no device there can hold it now) goes elsewhere, or waits."""
        if finish == "processing":
            task.sent = internals.processing_on(ts) or task.sent
        elif start == "processing" and stimulus_id.startswith(_SENT_BACK):
            worker, task.sent = task.sent, None
            if worker is not None and internals.in_service(self.scheduler, worker):  # no drain
                left = internals.restricted_to(ts) - {worker}
                internals.restrict_to_workers(ts, left or {NOWHERE})

    def fell_back(self, ts: Any, task: GpuTask) -> None:
        """The CPU form runs wherever its own restriction allows, with no device memory."""
        if task.need is not None:
            internals.restrict_to_workers(ts, task.own)
            task.need = task.own = task.sent = None


def _normalised(need: Requirement) -> dict[str, Any]:
    """The requirement as the worker reads it back (plain, msgpack-safe values)."""
    return {
        "memory": need.memory,
        "model": need.model,
        "capability": None if need.capability is None else list(need.capability),
        "mig": need.mig,
    }
