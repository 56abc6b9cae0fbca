"""What runs in one worker's threads now, and which device each GPU task holds.

The worker's state machine already caps how many GPU tasks run at once (its ``GPU``
resource, which the GuardPlugin set to the devices it owns). What it does not do is give
each running task its own device. :class:`LeaseTable` is the one record of the tasks whose
functions run in the worker's threads (the guard's transition hook says when one starts
and ends) and of the devices each holds; everything else about them is derived from it:
the busy devices, the GPU tasks a leak check waits for, whether a task ran alone.

Decisions only, no distributed import, and no waiting: :meth:`LeaseTable.grant` answers
with the devices a task takes (least busy first), None when it must wait for a lease to
end, or raises :class:`NoFreeDevice` when no device of this worker could ever hold it;
:mod:`accelsched.worker.binder` waits in the task's thread.

A task with a :class:`~accelsched.policy.requirements.Requirement` takes only a device
that meets it. One that declares memory shares a device with other declared tasks while
their needs fit (:func:`~accelsched.policy.requirements.pack`), never one a whole-device
task holds. The scheduler's accounting is per worker (its ``GPU`` and ``GPU-memory``
totals), so a task can arrive when the room it needs is split over two devices, or its
one matching device is busy: it waits until a lease ends.
"""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from accelsched.policy.requirements import (
    DeviceFacts,
    Requirement,
    capacity,
    held_counted,
    pack,
)

__all__ = ["Cancelled", "LeaseTable", "NoFreeDevice", "devices_needed"]


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
        self._devices: list[int] = list(devices)
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
            self._devices = list(devices)
            if facts is not None:
                self._facts = dict(facts)
            if shares is not None:
                self._shares = dict(shares)

    def _share(self, device: int) -> int:
        """Bytes declared tasks here may take on ``device``, before results (lock held)."""
        shared = self._shares.get(device)
        return capacity(self._facts[device].memory) if shared is None else shared

    # --- what runs (the transition hook, on the event loop) ----------------------------

    def started(self, key: Any, *, gpu: bool = False) -> None:
        """``key``'s function runs in a thread now (``gpu``: it asked for a GPU)."""
        with self._lock:
            task = self._tasks.get(key)
            if task is None:
                self._tasks[key] = _Task(True, gpu)
                self.changes += 1
            elif not task.counted:
                task.counted = True
                self.changes += 1

    def asks_gpu(self, key: Any) -> None:
        """``key``, counted as running, asked for a GPU: a leak check waits for it."""
        task = self._tasks.get(key)
        if task is not None:
            task.gpu = True

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
            load, declared = self._sums()
            n = devices_needed(amount)
            share, nbytes = (amount / n if n else 0.0), 0
            if requirement is None and not any(declared.values()):
                return self._hold(key, self._spread(key, n, share, load), share, nbytes)
            # a requirement, or declared tasks hold devices: eligible devices only
            eligible = self._eligible(requirement)
            need = None if requirement is None else requirement.memory  # bytes declared
            n = n if need is None else 1  # a declared need takes one device
            # devices claimed by whole-device tasks waiting since before this one: a
            # younger one's claim does not hold it back (no stream of them starves it)
            mine = math.inf if waiting is None else waiting.ticket
            claimed = {
                d for k, t in self._tasks.items() if k != key and t.ticket < mine for d in t.claimed
            }
            if len(eligible) < n:
                what = "a device" if n == 1 else f"{n} devices"
                meeting = "" if requirement is None else f" with {requirement.label()}"
                raise NoFreeDevice(
                    f"task {key!r} needs {what}{meeting}; this worker has {len(eligible)} "
                    f"of {self._devices}"
                )
            if need is not None:
                share, nbytes = 0.0, need
                held = {d: self._held(d) for d in eligible}
                for t in self._tasks.values():  # results about to enter memory: their
                    for d in t.left:  # room is held still, as by a lease about to end
                        declared[d] = declared.get(d, 0) + t.nbytes
                rooms = [(d, self._share(d), declared[d] + held[d]) for d in eligible]
                whole = [d for d in eligible if load[d] or d in claimed]
                one = pack(nbytes, rooms, whole=whole)
                chosen: tuple[int, ...] | None = None if one is None else (one,)
                if one is None and pack(need, [(d, r, held[d]) for d, r, _ in rooms]) is None:
                    self._unfit_for_results(key, need, eligible, held)
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
                    by_room = sorted(free, key=lambda d: (declared[d], load[d], d))
                    task = self._task(key)
                    task.claimed = tuple(by_room[:n])
                    if task.ticket == math.inf:
                        task.ticket = next(self._tickets)
            return None if chosen is None else self._hold(key, chosen, share, nbytes)

    def _unfit_for_results(
        self, key: Any, need: int, eligible: list[int], held: dict[int, int]
    ) -> None:
        """No lease ending makes room for ``need``: results held (or this worker's share)
        stand in the way. Sent back when it is more than the room this worker offers the
        scheduler (so it is not placed here again); else it waits for results to go: a
        room the scheduler cannot see split over devices (lock held)."""
        offered = sum(
            max(0, self._share(d) - held_counted(held[d], self._facts[d].memory)) for d in eligible
        )
        if need > offered:
            raise NoFreeDevice(
                f"task {key!r} declares {need} bytes; the room this worker's devices "
                f"{eligible} have beside the results they hold is {offered} bytes"
            )

    def _task(self, key: Any) -> _Task:
        """``key``'s record, made for a task whose start the hook has not seen (lock held)."""
        task = self._tasks.get(key)
        if task is None:
            task = self._tasks[key] = _Task(False, True)
        return task

    def _hold(
        self, key: Any, chosen: tuple[int, ...], share: float, nbytes: int
    ) -> tuple[int, ...]:
        task = self._task(key)
        task.devices, task.share, task.nbytes, task.claimed = chosen, share, nbytes, ()
        task.ticket = math.inf
        for d in chosen:
            self._gen[d] = self._gen.get(d, 0) + 1
        return chosen

    def _spread(self, key: Any, n: int, share: float, load: dict[int, float]) -> tuple[int, ...]:
        by_load = sorted(load, key=lambda d: (load[d], d))
        if share >= 1.0:
            # Whole devices: idle ones first. Fractions can leave every device partly
            # used while the worker's total says a whole one is free (fragmentation):
            # then share the least busy rather than fail. Devices fully held by other
            # whole-device tasks are never shared.
            candidates = [d for d in by_load if load[d] == 0] + [
                d for d in by_load if 0 < load[d] < 1 - 1e-9
            ]
        else:
            # fractions pack onto the fullest device they fit (best fit), keeping whole
            # devices idle for whole-device tasks; amounts that do not tile a device
            # (0.4, 1.5) go to the least busy when nothing fits
            fits = [d for d in by_load if load[d] > 0 and load[d] + share <= 1]
            candidates = sorted(fits, key=lambda d: -load[d]) + [
                d for d in by_load if d not in fits
            ]
        if len(candidates) < n:
            raise NoFreeDevice(
                f"task {key!r} needs {n} device(s) but only {len(candidates)} of "
                f"{self._devices} are free; busy: {self.holders()}"
            )
        return tuple(candidates[:n])

    def _eligible(self, requirement: Requirement | None) -> list[int]:
        """Devices that meet ``requirement`` (all, without one; none NVML did not describe)."""
        if requirement is None:
            return list(self._devices)
        facts = self._facts
        return [d for d in self._devices if d in facts and requirement.fits(facts[d])]

    def release(self, key: Any) -> None:
        """``key``'s lease ends (its thread, whatever happened)."""
        with self._lock:
            task = self._tasks.get(key)
            if task is None:
                return
            for d in task.devices:
                self._gen[d] = self._gen.get(d, 0) + 1
            task.left = task.devices if task.nbytes and task.counted else ()
            task.devices = task.claimed = ()
            task.ticket = math.inf
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
            return tuple(self._gen.get(d, 0) for d in task.devices)  # type: ignore[union-attr]

    def still_alone(self, key: Any, token: tuple[int, ...] | None) -> bool:
        with self._lock:
            task = self._tasks.get(key)
            mine = task.devices if task is not None else ()
            return token is not None and token == tuple(self._gen.get(d, 0) for d in mine)

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
        """Bytes declared by running tasks, per device."""
        with self._lock:
            return self._sums()[1]

    def __len__(self) -> int:
        """Tasks holding a lease."""
        return len(self.holders())
