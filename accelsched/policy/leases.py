"""Per-task device binding on a worker.

The worker's state machine already caps how many GPU tasks run at once (its ``GPU``
resource, which the GuardPlugin set to the devices it owns). What it does not do is give
each running task its own device. :class:`LeaseTable` hands out devices, least busy
first. Decisions only, no distributed import: :mod:`accelsched.worker.binder` acquires a
lease in the task's executor thread, so a task cancelled before it starts never holds a
device.

A task with a :class:`~accelsched.policy.requirements.Requirement` takes only a device
that meets it. One that declares memory shares a device with other declared tasks while
their needs fit (:func:`~accelsched.policy.requirements.pack`), never one a whole-device
task holds. The scheduler's accounting is per worker (its ``GPU`` and ``GPU-memory``
totals), so a task can arrive when the room it needs is split over two devices, or its
one matching device is busy: it waits here, in its thread, until a lease ends. A task no
device of this worker could ever hold raises :class:`NoFreeDevice` at once.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from accelsched.policy.requirements import DeviceFacts, Requirement, capacity, pack

__all__ = ["LeaseTable", "NoFreeDevice", "devices_needed"]


class NoFreeDevice(RuntimeError):
    """More GPU tasks run at once than the worker owns devices (a resource mis-set), or no
    device of the worker can ever hold the task (its requirement)."""


#: Seconds a waiting task sleeps between looks when no lease ends meanwhile: devices
#: may be withdrawn or given back while it waits.
WAIT_SLICE = 1.0


def devices_needed(amount: float) -> int:
    """Devices a task asking for ``amount`` GPU units holds: fractions share one device."""
    return max(1, math.ceil(amount)) if amount > 0 else 0


class LeaseTable:
    """Which task holds which device, in one worker. Thread-safe."""

    def __init__(self, devices: Sequence[int] = ()) -> None:
        self._lock = threading.Lock()
        self._freed = threading.Condition(self._lock)  # a lease ended
        self._waiting = 0
        self._devices: list[int] = list(devices)
        self._load: dict[int, float] = dict.fromkeys(self._devices, 0.0)
        self._declared: dict[int, int] = dict.fromkeys(self._devices, 0)  # bytes
        self._facts: dict[int, DeviceFacts] = {}
        self._held: dict[Any, tuple[tuple[int, ...], float]] = {}
        self._memory_held: dict[Any, tuple[int, int]] = {}  # key -> (device, bytes)
        self._gen: dict[int, int] = {}  # device -> acquisitions and releases so far

    @property
    def devices(self) -> list[int]:
        return list(self._devices)

    def set_devices(
        self, devices: Sequence[int], facts: Mapping[int, DeviceFacts] | None = None
    ) -> None:
        with self._lock:
            self._devices = list(devices)
            if facts is not None:
                self._facts = dict(facts)
            for d in self._devices:
                self._load.setdefault(d, 0.0)
                self._declared.setdefault(d, 0)
            self._freed.notify_all()

    def declared(self) -> dict[int, int]:
        """Bytes declared by running tasks, per device."""
        with self._lock:
            return {d: self._declared.get(d, 0) for d in self._devices}

    def acquire(
        self, key: Any, amount: float, requirement: Requirement | None = None
    ) -> tuple[int, ...]:
        if requirement:
            return self._acquire_required(key, amount, requirement)
        if amount == 1:  # the common case: one whole device, the lowest idle one
            with self._lock:
                load = self._load
                devices = self._devices
                declared = self._declared
                if len(devices) == 1:  # a one-device worker: that one, when idle
                    d0 = devices[0]
                    idle = devices if not load[d0] and not declared[d0] else ()
                else:
                    idle = [d for d in devices if not load[d] and not declared[d]]
                if idle:
                    d = min(idle)
                    load[d] = 1.0
                    self._gen[d] = self._gen.get(d, 0) + 1
                    self._held[key] = ((d,), 1.0)
                    return (d,)
        n = devices_needed(amount)
        share = amount / n if n else 0.0
        with self._lock:
            if any(self._declared.values()):  # declared tasks hold devices: wait for whole ones
                return self._wait_whole(key, n, share, None)
            by_load = sorted(self._devices, key=lambda d: (self._load[d], d))
            if share >= 1.0:
                # Whole devices: idle ones first. Fractions can leave every device partly
                # used while the worker's total says a whole one is free (fragmentation):
                # then share the least busy rather than fail. Devices fully held by other
                # whole-device tasks are never shared.
                candidates = [d for d in by_load if self._load[d] == 0] + [
                    d for d in by_load if 0 < self._load[d] < 1 - 1e-9
                ]
            else:
                # fractions pack onto the fullest device they fit (best fit), keeping
                # whole devices idle for whole-device tasks; amounts that do not tile a
                # device (0.4, 1.5) go to the least busy when nothing fits
                fits = [d for d in by_load if self._load[d] > 0 and self._load[d] + share <= 1]
                candidates = sorted(fits, key=lambda d: -self._load[d]) + [
                    d for d in by_load if d not in fits
                ]
            if len(candidates) < n:
                raise NoFreeDevice(
                    f"task {key!r} needs {n} device(s) but only {len(candidates)} of "
                    f"{self._devices} are free; busy: {dict(self._held)}"
                )
            chosen = tuple(candidates[:n])
            for d in chosen:
                self._load[d] += share
                self._gen[d] = self._gen.get(d, 0) + 1
            self._held[key] = (chosen, share)
            return chosen

    def _acquire_required(
        self, key: Any, amount: float, requirement: Requirement
    ) -> tuple[int, ...]:
        with self._lock:
            if requirement.memory is None:
                n = devices_needed(amount)
                return self._wait_whole(key, n, amount / n if n else 0.0, requirement)
            need = requirement.memory
            while True:
                eligible = self._eligible(requirement)
                if not any(capacity(self._facts[d].memory) >= need for d in eligible):
                    raise NoFreeDevice(
                        f"task {key!r} needs a device with {requirement.label()}; this "
                        f"worker's devices {self._devices} have none"
                    )
                rooms = [(d, capacity(self._facts[d].memory), self._declared[d]) for d in eligible]
                chosen = pack(need, rooms, whole=[d for d in eligible if self._load[d]])
                if chosen is not None:
                    self._declared[chosen] += need
                    self._gen[chosen] = self._gen.get(chosen, 0) + 1
                    self._memory_held[key] = (chosen, need)
                    self._held[key] = ((chosen,), 0.0)
                    return (chosen,)
                self._wait()

    def _wait_whole(
        self, key: Any, n: int, share: float, requirement: Requirement | None
    ) -> tuple[int, ...]:
        """``n`` whole devices (meeting ``requirement``) that no task holds; called and
        returning with the lock held, waiting for leases to end."""
        while True:
            eligible = self._eligible(requirement)
            if len(eligible) < n:
                what = "devices" if requirement is None else f"devices with {requirement.label()}"
                raise NoFreeDevice(
                    f"task {key!r} needs {n} {what}; this worker has {len(eligible)} of "
                    f"{self._devices}"
                )
            idle = [d for d in eligible if not self._load[d] and not self._declared[d]]
            if len(idle) >= n:
                chosen = tuple(sorted(idle)[:n])
                for d in chosen:
                    self._load[d] += share
                    self._gen[d] = self._gen.get(d, 0) + 1
                self._held[key] = (chosen, share)
                return chosen
            self._wait()

    def _eligible(self, requirement: Requirement | None) -> list[int]:
        """Devices that meet ``requirement`` (all, without one; none NVML did not describe)."""
        if requirement is None:
            return list(self._devices)
        facts = self._facts
        return [d for d in self._devices if d in facts and requirement.fits(facts[d])]

    def _wait(self) -> None:
        self._waiting += 1
        try:
            self._freed.wait(WAIT_SLICE)
        finally:
            self._waiting -= 1

    def release(self, key: Any) -> None:
        with self._lock:
            chosen, share = self._held.pop(key, ((), 0.0))
            for d in chosen:
                self._load[d] = max(0.0, self._load[d] - share)
                self._gen[d] = self._gen.get(d, 0) + 1
            held = self._memory_held.pop(key, None)
            if held is not None:
                d, nbytes = held
                self._declared[d] = max(0, self._declared.get(d, 0) - nbytes)
            if self._waiting:
                self._freed.notify_all()

    def alone_token(self, key: Any) -> tuple[int, ...] | None:
        """A token when ``key`` holds its devices alone now, else None. While
        :meth:`still_alone` says so, no other task took or gave back any of them."""
        with self._lock:
            mine = self._held.get(key, ((), 0.0))[0]
            if mine and len(self._held) == 1:  # nobody else holds anything
                return tuple([self._gen.get(d, 0) for d in mine])
            if not mine or any(
                set(mine) & set(devices) for k, (devices, _) in self._held.items() if k != key
            ):
                return None
            return tuple(self._gen.get(d, 0) for d in mine)

    def still_alone(self, key: Any, token: tuple[int, ...] | None) -> bool:
        with self._lock:
            mine = self._held.get(key, ((), 0.0))[0]
            return token is not None and token == tuple(self._gen.get(d, 0) for d in mine)

    def holders(self) -> dict[Any, tuple[int, ...]]:
        with self._lock:
            return {k: v[0] for k, v in self._held.items()}

    def busy(self) -> set[int]:
        """The devices some task holds now."""
        with self._lock:
            return {d for devices, _ in self._held.values() for d in devices}

    def __len__(self) -> int:
        return len(self._held)
