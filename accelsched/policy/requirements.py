"""What a GPU task needs: a count of GPUs, and of each device memory, model, capability, MIG.

A count says how many devices (:func:`invalid_amount` refuses what is none); a
:class:`Requirement` says which devices will do and how much of one a task takes.
Written on a step (``@gpu(memory="24GiB", model="H100*")``) or as an annotation
(``dask.annotate(gpu={"memory": "24GiB"})``), checked where it is written and again
where it is unpickled (the scheduler trusts no pickle), and compared against what NVML
verified of each device (:class:`DeviceFacts`). Decisions only: no distributed import.

- ``memory``: device memory the task needs (bytes; ``"24GiB"``). Tasks that declare it
  share a device while their declared needs fit in it (:func:`pack`); a device whose
  :func:`capacity` (its memory less a reserve) is smaller than the need is never eligible.
- ``model``: a shell pattern matched, case-insensitively, against the device's NVML
  name (``"*H100*"``, ``"NVIDIA A100*"``).
- ``capability``: the least CUDA compute capability, ``"8.0"`` or ``(8, 0)``.
- ``mig``: ``True`` for a MIG device only, ``False`` for a whole GPU only.
- ``enforce``: with ``memory``, whether an allocation past it fails
  (:mod:`accelsched.devices`); None: the guard's ``enforce_memory`` says.
  It says nothing of the device, so placement and :meth:`Requirement.label` ignore it.

**Leases** (:class:`LeaseTable`): what runs in one worker's threads now, and which device
each GPU task holds.

The worker's state machine already caps how many GPU tasks run at once (its ``GPU``
resource, which the GuardPlugin set to the devices it owns). What it does not do is give
each running task its own device. :class:`LeaseTable` is the one record of the tasks whose
functions run in the worker's threads (the guard's transition hook says when one starts
and ends) and of the devices each holds; everything else about them is derived from it:
the busy devices, the GPU tasks a leak check waits for, whether a task ran alone.

Decisions only, no distributed import, and no waiting: :meth:`LeaseTable.grant` answers
with the devices a task takes (least busy first), None when it must wait for a lease to
end, or raises :class:`NoFreeDevice` when no device of this worker could ever hold it;
:mod:`accelsched.worker.guard_plugin` waits in the task's thread.

A task with a :class:`Requirement` takes only a device
that meets it. One that declares memory shares a device with other declared tasks while
their needs fit (:func:`pack`), never one a whole-device
task holds. The scheduler's accounting is per worker (its ``GPU`` and ``GPU-memory``
totals), so a task can arrive when the room it needs is split over two devices, or its
one matching device is busy: it waits until a lease ends.
"""

from __future__ import annotations

import fnmatch
import itertools
import math
import numbers
import re
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from accelsched.config import size_bytes
from accelsched.devices import DeviceFacts

__all__ = [
    "Cancelled",
    "Conflict",
    "DeviceFacts",
    "KEYS",
    "LeaseTable",
    "NoFreeDevice",
    "Requirement",
    "capacity",
    "combine",
    "devices_needed",
    "invalid_amount",
    "mebibytes",
    "pack",
    "parse_requirement",
    "requirement_problem",
]


#: The keys a requirement may have; any other is refused, named.
KEYS = ("memory", "model", "capability", "mig", "enforce")
#: Most bytes a requirement may ask (1 EiB, 1024PiB): more is a typo, not a device.
MAX_MEMORY = 1 << 60
#: Longest model pattern taken.
MAX_PATTERN = 200

_CAPABILITY = re.compile(r"^\s*(\d{1,3})\.(\d{1,3})\s*$")
#: A size in bytes with a fraction ("1.5", "0.5B"), which no allocation can be.


def invalid_amount(amount: Any) -> str | None:
    """Why ``resources={"GPU": amount}`` (or a step's count) cannot be placed, or None.

    Zero, negative, NaN and infinite amounts would match GPU-less or every worker in
    plain distributed, or none at all; they err instead, naming the value.
    """
    if (type(amount) is int or type(amount) is float) and 0 < amount < math.inf:
        return None  # the common case, without ABCs
    try:
        if (
            isinstance(amount, numbers.Real)
            and not isinstance(amount, bool)
            and 0 < float(amount) < math.inf
        ):
            return None
    except (OverflowError, ValueError):
        pass
    return f"invalid resources={{'GPU': {amount!r}}}: expected a positive, finite number of GPUs"


def device_count_problem(need: Requirement | None, count: float) -> str | None:
    """Why a task asking ``count`` GPUs cannot have the requirement ``need``, or None: one
    that declares memory shares a single device (its memory is what it takes)."""
    if need is not None and need.memory is not None and count != 1:
        return f"{need.label()}: a task that declares memory takes one device, not {count}"
    return None


@dataclass(frozen=True)
class Requirement:
    """What one GPU task needs of each device it holds; None: anything goes."""

    memory: int | None = None
    model: str | None = None
    capability: tuple[int, int] | None = None
    mig: bool | None = None
    enforce: bool | None = None

    def __bool__(self) -> bool:
        return any(v is not None for v in (self.memory, self.model, self.capability, self.mig))

    def fits(self, device: DeviceFacts) -> bool:
        """Whether ``device`` can ever hold the task: its attributes, and for declared
        memory what tasks may declare there (:func:`capacity`), the one rule both the
        scheduler's eligibility and the worker's lease table go by."""
        return (
            (self.memory is None or capacity(device.memory) >= self.memory)
            and (
                self.model is None
                or fnmatch.fnmatchcase(device.name.casefold(), self.model.casefold())
            )
            and (
                self.capability is None
                or (device.capability is not None and device.capability >= self.capability)
            )
            and (self.mig is None or device.mig == self.mig)
        )

    def label(self) -> str:
        """A short, stable name for this requirement: events, status, resource names."""
        cc, mig = self.capability, self.mig
        parts = (
            "" if self.memory is None else f"memory>={_bytes_text(self.memory)}",
            "" if self.model is None else f"model={self.model}",
            "" if cc is None else f"capability>={cc[0]}.{cc[1]}",
            "" if mig is None else "mig" if mig else "whole-gpu",
        )
        return ",".join(p for p in parts if p) or "any"


def _bytes_text(n: int) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return f"{n}B"


def _memory(value: Any) -> int | None:
    if isinstance(value, str) and (value := size_bytes(value)) is None:
        return None  # no size, no number ("GiB"), or a fraction of a byte ("1.5")
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    return int(value) if ok and 0 < int(value) <= MAX_MEMORY else None


def capability_of(value: Any) -> tuple[int, int] | None:
    """A compute capability as ``(major, minor)`` (``"8.0"``, ``(8, 0)``), or None."""
    if isinstance(value, str) and (m := _CAPABILITY.match(value)):
        return int(m.group(1)), int(m.group(2))
    if (
        isinstance(value, (tuple, list))
        and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1000 for v in value)
    ):
        return int(value[0]), int(value[1])
    return None


#: Per key: what reads a given value (None: not one), and what was expected instead.
_FIELDS: dict[str, tuple[Callable[[Any], Any], str]] = {
    "memory": (_memory, "expected whole bytes, 1 to 1024PiB, or a size such as '24GiB'"),
    "model": (
        lambda v: (
            v
            if isinstance(v, str) and v.strip() and len(v) <= MAX_PATTERN and v.isprintable()
            else None
        ),
        f"expected a name pattern such as '*H100*' (at most {MAX_PATTERN} characters, "
        "none unprintable)",
    ),
    "capability": (capability_of, "expected 'major.minor' such as '8.0', or (8, 0)"),
    "mig": (
        lambda v: v if isinstance(v, bool) else None,
        "expected True (a MIG device) or False (a whole GPU)",
    ),
    "enforce": (
        lambda v: v if isinstance(v, bool) else None,
        "expected True (an allocation past memory= fails) or False",
    ),
}


def _shown(value: Any) -> str:
    """``repr(value)``, short: a bad value is named, not copied whole into the error."""
    try:
        text = repr(value)
    except ValueError:  # an int past the digits Python converts to text
        return f"<an integer of {int(value).bit_length()} bits>"
    return text if len(text) <= 80 else f"{text[:77]}..."


def parse_requirement(value: Any) -> Requirement:
    """A :class:`Requirement` from a mapping (an annotation, ``gpu(**kwargs)``), or one
    already built (checked again: it may come from a pickle). ``ValueError`` names the bad
    key or value; None and ``{}`` are "anything goes"."""
    if value is None:
        return Requirement()
    if isinstance(value, Conflict):
        raise ValueError(f"invalid GPU requirement: {value.label()}")
    if isinstance(value, Requirement):
        given: Mapping[str, Any] = {k: getattr(value, k) for k in KEYS}
    elif isinstance(value, Mapping):
        if unknown := sorted(map(repr, set(value) - set(KEYS))):
            raise ValueError(
                f"unknown GPU requirement key(s) {', '.join(unknown)}: expected {', '.join(KEYS)}"
            )
        given = value
    else:
        raise ValueError(
            f"invalid GPU requirement {value!r}: expected a mapping of {', '.join(KEYS)}"
        )
    # each key given read by its own reader (None: not one), the first bad one named
    parsed = {k: _FIELDS[k][0](given[k]) for k in KEYS if given.get(k) is not None}
    if (bad := next((k for k, v in parsed.items() if v is None), None)) is not None:
        raise ValueError(f"invalid GPU requirement {bad}={_shown(given[bad])}: {_FIELDS[bad][1]}")
    if "enforce" in parsed and "memory" not in parsed:
        raise ValueError(
            f"invalid GPU requirement enforce={parsed['enforce']!r} without memory: "
            "it holds a task to the memory it declares (memory='2GiB')"
        )
    return Requirement(**parsed)


def requirement_problem(value: Any) -> str | None:
    """Why ``value`` is no requirement, or None."""
    try:
        parse_requirement(value)
    except ValueError as exc:
        return str(exc)
    return None


@dataclass(frozen=True)
class Conflict(Requirement):
    """Requirements no one device can meet at once (steps fused into one task that ask
    for different models, or MIG and a whole GPU): the task errs, naming them."""

    text: str = ""

    def __bool__(self) -> bool:
        return True

    def fits(self, device: DeviceFacts) -> bool:
        return False

    def label(self) -> str:
        return f"conflicting: {self.text}"


def combine(requirements: list[Requirement]) -> Requirement | None:
    """What one task calling several marked steps needs: the most memory, the highest
    capability, enforced if one step enforces; models and MIG must agree (else a
    :class:`Conflict`)."""
    if not requirements:
        return None
    if len(requirements) == 1:
        return requirements[0]
    models = {r.model for r in requirements if r.model is not None}
    migs = {r.mig for r in requirements if r.mig is not None}
    if len(models) > 1 or len(migs) > 1:
        return Conflict(text=" and ".join(sorted({r.label() for r in requirements})))
    memories = [r.memory for r in requirements if r.memory is not None]
    capabilities = [r.capability for r in requirements if r.capability is not None]
    enforced = {r.enforce for r in requirements if r.enforce is not None}
    return Requirement(
        memory=max(memories) if memories else None,
        model=models.pop() if models else None,
        capability=max(capabilities) if capabilities else None,
        mig=migs.pop() if migs else None,
        enforce=max(enforced) if enforced else None,  # one step that enforces: enforced
    )


#: What a device keeps back from declared tasks: a twentieth of it, at most 2 GiB
#: (CUDA contexts, library handles, the allocator's slack).
RESERVE_FRACTION = 20
MAX_RESERVE = 2 << 30
MiB = 1 << 20


def capacity(memory: int) -> int:
    """Bytes tasks may declare on a device of ``memory`` bytes (what :func:`pack` fills):
    whole MiB, as the scheduler places declared tasks by MiB (:func:`mebibytes`), so the
    room it places against is never more than the room a worker packs against."""
    return max(0, memory - min(memory // RESERVE_FRACTION, MAX_RESERVE)) // MiB * MiB


def share(memory: int, sharers: int = 1) -> int:
    """Bytes one of ``sharers`` workers driving a device of ``memory`` bytes may declare
    on it (``share_gpus``): its capacity divided equally (whole MiB, as the capacity), so
    that every worker packing its own share never packs the device past what it holds."""
    return capacity(memory) // max(1, sharers) // MiB * MiB


#: Results held on a device count against its room in steps of this fraction of it.
HELD_STEPS = 16


def held_counted(held: int, memory: int) -> int:
    """What results holding ``held`` bytes on a device of ``memory`` bytes take from the
    room a worker offers: rounded up to a sixteenth of the device (at least 1 MiB), so
    the figure the scheduler places against changes once per step, not with every
    result, and never says more room than there is (a step is whole MiB)."""
    step = max(1, memory // HELD_STEPS // MiB) * MiB
    return -(-max(0, held) // step) * step


def mebibytes(nbytes: int) -> int:
    """A declared need as distributed's resource amount: whole MiB, rounded up (a room is
    counted in whole MiB rounded down: a need placed in a room always fits it)."""
    return -(-nbytes // MiB)


def pack(
    need: int, devices: Iterable[tuple[int, int, int]], *, whole: Iterable[int] = ()
) -> int | None:
    """The device a task declaring ``need`` bytes goes to, or None when none has room.

    ``devices``: ``(index, capacity, leased)`` for each eligible device, capacity being
    what tasks may declare on it (its memory less a reserve), leased what running tasks
    declared there. ``whole``: devices a task without a memory declaration holds (they
    share with nobody). Best fit: the device left with the least room, so small tasks
    fill one device and leave another whole for a large one.
    """
    held = set(whole)
    left = [(room - leased - need, i) for i, room, leased in devices if i not in held]
    return min(((n, i) for n, i in left if n >= 0), default=(0, None))[1]


class NoFreeDevice(RuntimeError):
    """More GPU tasks run at once than the worker owns devices (a resource mis-set), or no
    device of the worker can ever hold the task (its requirement)."""


class Cancelled(RuntimeError):
    """The task was cancelled while it waited for a lease: its thread stops waiting."""


def devices_needed(amount: float) -> int:
    """Devices a task asking for ``amount`` GPU units holds: fractions share one device."""
    return max(1, math.ceil(amount)) if amount > 0 else 0


@dataclass(slots=True)
class _Task:
    """One running task: the devices it holds (with its share of each, or the bytes it
    declared on its one device); ``counted``: the transition hook saw it start and has
    not seen it end; ``gpu``: it asked for a GPU."""

    counted: bool
    gpu: bool
    devices: tuple[int, ...] = ()
    share: float = 0.0
    nbytes: int = 0
    claimed: tuple[int, ...] = ()  # whole devices it waits for: nobody packs onto them
    # its lease ended, its result not yet in memory: its declared bytes count there still
    left: tuple[int, ...] = ()
    cancelled: bool = False  # cancelled while it waited: it stops waiting, claims nothing
    ticket: float = math.inf  # its place among the whole-device tasks waiting (lower: older)


class LeaseTable:
    """The tasks running in one worker's threads and the devices they hold. Thread-safe:
    the transition hook writes on the event loop, leases are taken in executor threads."""

    def __init__(
        self, devices: Sequence[int] = (), held: Callable[[int], int] | None = None
    ) -> None:
        self._lock = threading.Lock()
        self._devices: list[int] = sorted(devices)  # (in order: the first idle is the least)
        self._facts: dict[int, DeviceFacts] = {}
        #: bytes the results in the worker's memory hold on a device (the ledger's)
        self._held: Callable[[int], int] = held or (lambda device: 0)
        self._shares: dict[int, int] = {}  # device -> bytes this worker may declare there
        self._tasks: dict[Any, _Task] = {}
        self._gen: dict[int, int] = {}  # device -> leases taken and given back there
        self._tickets = itertools.count()  # whole-device tasks that waited, in turn
        #: Tasks started or ended so far (whether one ran alone in the process).
        self.changes = 0

    def set_devices(
        self,
        devices: Sequence[int],
        facts: Mapping[int, DeviceFacts] | None = None,
        shares: Mapping[int, int] | None = None,
    ) -> None:
        """Lease ``devices``, described by ``facts``; ``shares``: the bytes declared tasks
        of this worker may take on each (the scheduler's division of a device several
        workers share; a device not named: its capacity). None keeps what was set."""
        with self._lock:
            self._devices = sorted(devices)
            if facts is not None:
                self._facts = dict(facts)
            if shares is not None:
                self._shares = dict(shares)

    # --- what runs (the transition hook, on the event loop) ----------------------------

    def started(self, key: Any, *, gpu: bool = False) -> None:
        """``key``'s function runs in a thread now (``gpu``: it asked for a GPU)."""
        with self._lock:
            task = self._tasks.get(key)
            if task is None:
                task = self._tasks[key] = _Task(False, gpu)
            if not task.counted:
                task.counted = True
                self.changes += 1

    def asks_gpu(self, key: Any) -> None:
        """``key``, counted as running, asked for a GPU: a leak check waits for it."""
        self._tasks[key].gpu = True  # (counted just before, on the event loop)

    def cancel(self, key: Any) -> bool:
        """``key`` was cancelled while its thread runs: if it waits for a lease, it claims
        nothing more and its next :meth:`grant` raises :class:`Cancelled`; whether it
        was waiting (one that holds its lease runs to its end)."""
        with self._lock:
            task = self._tasks.get(key)
            if task is None or task.devices:
                return False
            task.cancelled, task.claimed = True, ()
            return True

    def resume(self, key: Any) -> None:
        """``key``, cancelled while it ran, is wanted again: it waits for a lease again."""
        with self._lock:
            if (task := self._tasks.get(key)) is not None:
                task.cancelled = False

    def ended(self, key: Any) -> bool:
        """``key``'s function returned; whether it was counted as running."""
        with self._lock:
            task = self._tasks.get(key)
            if task is None or not task.counted:
                return False
            self.changes += 1
            if task.devices:  # its lease ends in its thread
                task.counted = False
            else:
                del self._tasks[key]
            return True

    def __contains__(self, key: Any) -> bool:
        return key in self._tasks

    def running(self) -> int:
        """Tasks counted as running in this worker's threads."""
        with self._lock:
            return sum(t.counted for t in self._tasks.values())

    def gpu_keys(self) -> set[Any]:
        """Keys of GPU tasks in threads now, leased or about to be."""
        with self._lock:
            return {k for k, t in self._tasks.items() if t.gpu}

    # --- leases (executor threads) ------------------------------------------------------

    def grant(
        self, key: Any, amount: float, requirement: Requirement | None = None
    ) -> tuple[int, ...] | None:
        """Lease devices to ``key`` now and name them; None when it must wait for a lease
        to end. Raises :class:`NoFreeDevice` when no device here can ever hold it."""
        with self._lock:
            if (waiting := self._tasks.get(key)) is not None:
                if waiting.cancelled:
                    raise Cancelled(f"task {key!r} was cancelled while it waited for a device")
                waiting.claimed = ()  # claimed again below if it still waits
            if amount == 1 and requirement is None:
                # one whole device, the common lease: the first idle one (what the sorted
                # path below chooses), unless a declared task holds a device (below)
                busy: set[int] = set()
                for t in self._tasks.values():
                    if t.nbytes and t.devices:
                        break
                    busy.update(t.devices)
                else:
                    for d in self._devices:
                        if d not in busy:
                            return self._hold(key, (d,), 1.0, 0, waiting)
            n = devices_needed(amount)
            share = amount / n if n else 0.0
            if requirement is None and (loads := self._loads()) is not None:
                # Fractions pack onto the fullest used device they fit (best fit),
                # keeping whole devices idle for whole-device tasks; amounts that do not
                # tile a device (0.4, 1.5) go to the least busy when nothing fits. Whole
                # devices (which fit no used one): idle ones first. Fractions can leave
                # every device partly used while the worker's total says a whole one is
                # free (fragmentation): then share the least busy rather than fail.
                # Devices fully held by other whole-device tasks are never shared.
                spread = sorted(
                    (d for d in loads if share < 1.0 or loads[d] < 1 - 1e-9),
                    key=lambda d: (
                        (0, -loads[d], d)  # (a whole device packs onto no shared one)
                        if share < 1.0 and loads[d] > 0 and loads[d] + share <= 1
                        else (1, loads[d], d)
                    ),
                )
                if len(spread) < n:
                    raise NoFreeDevice(
                        f"task {key!r} needs {n} device(s) but only {len(spread)} of "
                        f"{self._devices} are free; busy: {self.holders()}"
                    )
                return self._hold(key, tuple(spread[:n]), share, 0, waiting)
            # a requirement, or declared tasks hold devices: eligible devices only
            load, declared = self._sums()
            # devices that meet the requirement (all, without one; none NVML did not
            # describe)
            facts = self._facts
            eligible = [
                d
                for d in self._devices
                if requirement is None or (d in facts and requirement.fits(facts[d]))
            ]
            need = None if requirement is None else requirement.memory  # bytes declared
            n = n if need is None else 1  # a declared need takes one device
            # devices claimed by whole-device tasks waiting since before this one: a
            # younger one's claim does not hold it back (no stream of them starves it)
            mine = math.inf if waiting is None else waiting.ticket
            claimed = {
                d for k, t in self._tasks.items() if k != key and t.ticket < mine for d in t.claimed
            }
            if len(eligible) < n:
                raise NoFreeDevice(
                    f"task {key!r} needs {'a device' if n == 1 else f'{n} devices'}"
                    f"{'' if requirement is None else f' with {requirement.label()}'}; "
                    f"this worker has {len(eligible)} of {self._devices}"
                )
            if need is not None:
                held = {d: self._held(d) for d in eligible}
                self._add_left(declared)
                # bytes declared tasks here may take on each, before results: this
                # worker's share of a device others share too, else its capacity
                room = {
                    d: self._shares[d] if d in self._shares else capacity(facts[d].memory)
                    for d in eligible
                }
                rooms = [(d, room[d], declared[d] + held[d]) for d in eligible]
                # (devices a whole-device task holds or waits for share with nobody)
                one = pack(need, rooms, whole=[d for d in eligible if load[d] or d in claimed])
                chosen: tuple[int, ...] | None = None if one is None else (one,)
                if one is None and pack(need, [(d, r, held[d]) for d, r, _ in rooms]) is None:
                    # No lease ending makes room for it: results held (or this worker's
                    # share) stand in the way. Sent back when it is more than the room
                    # this worker offers the scheduler (so it is not placed here again);
                    # else it waits for results to go: a room the scheduler cannot see
                    # split over devices.
                    offered = sum(
                        max(0, room[d] - held_counted(held[d], facts[d].memory)) for d in eligible
                    )
                    if need > offered:
                        raise NoFreeDevice(
                            f"task {key!r} declares {need} bytes; the room this worker's "
                            f"devices {eligible} have beside the results they hold is "
                            f"{offered} bytes"
                        )
            else:  # whole devices no task holds, nor another waiting task claimed
                free = sorted(d for d in eligible if d not in claimed)
                idle = [d for d in free if not load[d] and not declared[d]]
                chosen = tuple(idle[:n]) if len(idle) >= n else None
                if chosen is None:
                    # it waits: it claims the devices it waits for (the least declared
                    # on; what older claims leave, if fewer than it needs), so no new
                    # declared task packs onto them, nor a younger whole-device task
                    # claims them, and it starts once the tasks holding them end, not
                    # when a stream of them dries up
                    task = self._task(key)
                    task.claimed = tuple(sorted(free, key=lambda d: (declared[d], load[d], d))[:n])
                    if task.ticket == math.inf:
                        task.ticket = next(self._tickets)
            # a declared need holds its bytes, no share of the device
            return (
                None
                if chosen is None
                else self._hold(key, chosen, 0.0 if need else share, need or 0, waiting)
            )

    def _task(self, key: Any) -> _Task:
        """``key``'s record, made for a task whose start the hook has not seen (lock held)."""
        task = self._tasks.get(key)
        if task is None:
            task = self._tasks[key] = _Task(False, True)
        return task

    def _hold(
        self, key: Any, chosen: tuple[int, ...], share: float, nbytes: int, task: _Task | None
    ) -> tuple[int, ...]:
        """``key`` (``task``: its record, if it has one) holds ``chosen`` (lock held)."""
        task = self._task(key) if task is None else task
        task.devices, task.share, task.nbytes = chosen, share, nbytes
        task.claimed, task.ticket = (), math.inf  # it waits no more
        gen = self._gen  # (a loop: no comprehension, no Counter, per GPU task)
        for d in chosen:
            gen[d] = gen.get(d, 0) + 1
        return chosen

    def release(self, key: Any) -> None:
        """``key``'s lease ends (its thread, whatever happened)."""
        with self._lock:
            task = self._tasks.get(key)
            if task is None:
                return
            gen = self._gen
            for d in task.devices:
                gen[d] = gen.get(d, 0) + 1
            task.left = task.devices if task.nbytes and task.counted else ()
            task.devices, task.claimed, task.ticket = (), (), math.inf
            if not task.counted:
                del self._tasks[key]

    # --- derived ----------------------------------------------------------------------

    def alone_token(self, key: Any) -> tuple[int, ...] | None:
        """A token when ``key`` holds its devices alone now, else None. While
        :meth:`still_alone` says so, no other task took or gave back any of them."""
        with self._lock:
            task = self._tasks.get(key)
            mine = set(task.devices if task is not None else ())
            if not mine or any(
                mine.intersection(t.devices) for k, t in self._tasks.items() if k != key
            ):
                return None
            return tuple(map(self._gen.__getitem__, task.devices))  # type: ignore[union-attr]

    def still_alone(self, key: Any, token: tuple[int, ...] | None) -> bool:
        with self._lock:
            task = self._tasks.get(key)
            mine = task.devices if task is not None else ()
            return token is not None and token == tuple(map(self._gen.__getitem__, mine))

    def _loads(self) -> dict[int, float] | None:
        """The shares held on each device; None when a declared task holds one (lock
        held). A lease without a requirement, the common case, sums no bytes."""
        load = dict.fromkeys(self._devices, 0.0)
        for t in self._tasks.values():
            for d in t.devices:
                if d in load:
                    if t.nbytes:
                        return None
                    load[d] += t.share
        return load

    def _sums(self) -> tuple[dict[int, float], dict[int, int]]:
        """The shares held and the bytes declared on each device (lock held)."""
        load = dict.fromkeys(self._devices, 0.0)
        declared = dict.fromkeys(self._devices, 0)
        for t in self._tasks.values():
            for d in t.devices:
                if d in load:
                    load[d] += t.share
                    declared[d] += t.nbytes
        return load, declared

    def holders(self) -> dict[Any, tuple[int, ...]]:
        """The devices each leased task holds."""
        return {k: t.devices for k, t in list(self._tasks.items()) if t.devices}

    def busy(self) -> set[int]:
        """The devices some task holds now."""
        with self._lock:
            return {d for t in self._tasks.values() for d in t.devices}

    def declared(self) -> dict[int, int]:
        """Bytes declared by running tasks, and by results about to enter memory (their
        room is held still), per device."""
        with self._lock:
            return self._add_left(self._sums()[1])

    def _add_left(self, declared: dict[int, int]) -> dict[int, int]:
        """``declared``, with the bytes of results about to enter memory: their room is
        held still, as by a lease about to end (lock held)."""
        for t in self._tasks.values():
            for d in t.left:
                declared[d] = declared.get(d, 0) + t.nbytes
        return declared
