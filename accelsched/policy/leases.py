"""Per-task device binding on a worker.

The worker's state machine already caps how many GPU tasks run at once (its ``GPU``
resource, which the GuardPlugin set to the devices it owns). What it does not do is give
each running task its own device. :class:`LeaseTable` hands out devices, least busy
first. Decisions only, no distributed import: :mod:`accelsched.worker.binder` acquires a
lease in the task's executor thread, so a task cancelled before it starts never holds a
device.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from typing import Any

__all__ = ["LeaseTable", "NoFreeDevice", "devices_needed"]


class NoFreeDevice(RuntimeError):
    """More GPU tasks run at once than the worker owns devices (a resource mis-set)."""


def devices_needed(amount: float) -> int:
    """Devices a task asking for ``amount`` GPU units holds: fractions share one device."""
    return max(1, math.ceil(amount)) if amount > 0 else 0


class LeaseTable:
    """Which task holds which device, in one worker. Thread-safe."""

    def __init__(self, devices: Sequence[int] = ()) -> None:
        self._lock = threading.Lock()
        self._devices: list[int] = list(devices)
        self._load: dict[int, float] = dict.fromkeys(self._devices, 0.0)
        self._held: dict[Any, tuple[tuple[int, ...], float]] = {}
        self._gen: dict[int, int] = {}  # device -> acquisitions and releases so far

    @property
    def devices(self) -> list[int]:
        return list(self._devices)

    def set_devices(self, devices: Sequence[int]) -> None:
        with self._lock:
            self._devices = list(devices)
            for d in self._devices:
                self._load.setdefault(d, 0.0)

    def acquire(self, key: Any, amount: float) -> tuple[int, ...]:
        if amount == 1:  # the common case: one whole device, the lowest idle one
            with self._lock:
                load = self._load
                devices = self._devices
                if len(devices) == 1:  # a one-device worker: that one, when idle
                    idle = devices if not load[devices[0]] else ()
                else:
                    idle = [d for d in devices if not load[d]]
                if idle:
                    d = min(idle)
                    load[d] = 1.0
                    self._gen[d] = self._gen.get(d, 0) + 1
                    self._held[key] = ((d,), 1.0)
                    return (d,)
        n = devices_needed(amount)
        share = amount / n if n else 0.0
        with self._lock:
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

    def release(self, key: Any) -> None:
        with self._lock:
            chosen, share = self._held.pop(key, ((), 0.0))
            for d in chosen:
                self._load[d] = max(0.0, self._load[d] - share)
                self._gen[d] = self._gen.get(d, 0) + 1

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
