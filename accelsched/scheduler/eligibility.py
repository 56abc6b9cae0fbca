"""Which workers may run a task with a requirement: those with a verified device meeting it.

A task whose step or annotation says what its device must be (memory, model, compute
capability, MIG; :mod:`accelsched.policy.requirements`) is restricted to the workers
whose granted devices, as NVML verified them, include one that meets it. A task that
declares memory takes ``GPU-memory`` (MiB) instead of a whole ``GPU``, so tasks share a
device while their needs fit; the worker's lease table packs them per device. The
requirement travels to the worker normalised in the task's ``gpu`` annotation.

When a worker's devices are granted, every waiting task it can serve gains it; a
requirement no verified device in the cluster meets is said once (``unmet-requirement``)
and its tasks wait, or run their CPU form after their timeout, as any unplaced GPU task.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from accelsched import events, internals
from accelsched.policy.requirements import (
    DeviceFacts,
    Requirement,
    capacity,
    mebibytes,
    parse_requirement,
)
from accelsched.protocol import GPU, GPU_MEMORY, REQUIREMENT_ANNOTATION, DeviceRecord
from accelsched.scheduler.grants import Grants

if TYPE_CHECKING:
    from distributed import Scheduler

__all__ = ["Eligibility", "facts_of", "memory_capacity"]

#: Task states in which the scheduler has not yet chosen a worker: restrictions count.
_UNPLACED = frozenset({"released", "waiting", "no-worker", "queued"})
#: A worker address no worker has: the restriction of a task no worker can serve yet.
NOWHERE = "accelsched://no-verified-device-meets-the-requirement"


def facts_of(record: DeviceRecord) -> DeviceFacts:
    """A granted device as requirements see it (a guard's report, checked types)."""
    cc = record.get("capability")
    capability = (
        (int(cc[0]), int(cc[1]))
        if isinstance(cc, (list, tuple)) and len(cc) == 2 and all(isinstance(v, int) for v in cc)
        else None
    )
    return DeviceFacts(
        str(record["name"]), int(record["memory"]), capability, record.get("mig") is True
    )


def memory_capacity(records: list[DeviceRecord], count: int) -> int:
    """``GPU-memory`` (MiB) a worker offers: its first ``count`` granted devices'
    capacity (fewer while one is withdrawn: which one the offer does not say)."""
    return sum(mebibytes(capacity(int(d["memory"]))) for d in records[:count])


class Eligibility:
    """Tasks with requirements, by requirement; which workers can serve each."""

    def __init__(self, grants: Grants, *, emit: Callable[..., None]) -> None:
        self.scheduler: Scheduler | None = None
        self._grants = grants
        self._emit = emit
        self._tasks: dict[str, set[Any]] = {}  # requirement label -> task keys
        self._label: dict[Any, str] = {}  # task key -> its requirement's label
        self._requirements: dict[str, Requirement] = {}  # label -> requirement
        self._unmet: dict[str, int] = {}  # label -> tasks seen while no device meets it

    def start(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def prepare(self, ts: Any, requirement: Any, count: float) -> str | None:
        """Restrict a new GPU task by its requirement; a problem to err it with, or None."""
        try:
            need = parse_requirement(requirement)
        except ValueError as exc:
            return str(exc)
        if not need:
            return None
        if need.memory is not None and count != 1:
            return f"{need.label()}: a task that declares memory takes one device, not {count}"
        label = need.label()
        internals.annotate(ts, REQUIREMENT_ANNOTATION, _normalised(need))
        if need.memory is not None:  # shares a device: memory, not a whole GPU
            restrictions = {k: v for k, v in ts.resource_restrictions.items() if k != GPU}
            restrictions[GPU_MEMORY] = mebibytes(need.memory)
            internals.set_resource_restrictions(ts, restrictions)
            internals.drop_annotated_resource(ts, GPU)
        self._requirements[label] = need
        self._tasks.setdefault(label, set()).add(ts.key)
        self._label[ts.key] = label
        workers = self.serving(need)
        internals.restrict_to_workers(ts, workers or {NOWHERE})
        if not workers:
            first = label not in self._unmet
            self._unmet[label] = self._unmet.get(label, 0) + 1
            if first:
                self._emit(events.UNMET_REQUIREMENT, None, requirement=label, key=str(ts.key))
        return None

    def serving(self, need: Requirement) -> set[str]:
        """Workers with a granted (verified) device that meets ``need``."""
        return {
            worker
            for worker, records in self._grants.granted_devices().items()
            if any(need.fits(facts_of(r)) for r in records)
        }

    def refresh(self, worker: str) -> None:
        """``worker``'s devices were granted: every unplaced task it can serve gains it."""
        scheduler = self.scheduler
        if scheduler is None:
            return
        records = self._grants.granted_devices().get(worker, [])
        facts = [facts_of(r) for r in records]
        for label, keys in self._tasks.items():
            if not any(self._requirements[label].fits(f) for f in facts):
                continue
            self._unmet.pop(label, None)
            for key in keys:
                ts = scheduler.tasks.get(key)
                if ts is None or ts.state not in _UNPLACED:
                    continue
                current = internals.restricted_to(ts) - {NOWHERE}
                internals.restrict_to_workers(ts, current | {worker})

    def forget(self, key: Any) -> None:
        """A forgotten task, or one that fell back (its CPU form runs anywhere)."""
        label = self._label.pop(key, None)
        if label is None:
            return
        keys = self._tasks.get(label, set())
        keys.discard(key)
        if not keys:
            self._tasks.pop(label, None)
            self._requirements.pop(label, None)

    def fell_back(self, ts: Any) -> None:
        """The CPU form runs anywhere: no worker restriction, no device memory."""
        if ts.key in self._label:
            internals.restrict_to_workers(ts, None)
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
