"""Per-task device binding on the worker: each GPU task holds its own device(s).

The worker's state machine caps how many GPU tasks run at once (its ``GPU`` resource).
The runners here, called in the task's executor thread, take a lease from the
:class:`~accelsched.policy.leases.LeaseTable`, make the device current for the task
(:func:`accelsched.context.holding`), free pools as the task ends, and give the lease
back whatever happens. A task that fell back to its CPU form gets its device-array
inputs copied to the host first.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from dask.utils import key_split
from distributed import Reschedule

from accelsched import events
from accelsched.context import Lease, bind, unbind
from accelsched.devices.arrays import to_host
from accelsched.devices.records import DeviceInfo
from accelsched.policy.leases import LeaseTable, NoFreeDevice
from accelsched.policy.requirements import DeviceFacts, Requirement, parse_requirement
from accelsched.worker.ledger import MEASURE, Ledger
from accelsched.worker.pool_freer import PoolFreer

__all__ = ["Binder", "send_back"]

Runner = Callable[[Any, dict], Any]


class Binder:
    """Leases of this worker's granted devices, and the runners that take them."""

    def __init__(
        self,
        *,
        oom_exceptions: tuple[str, ...],
        pools: PoolFreer,
        emit: Callable[..., None],
        ledger: Ledger | None = None,
        residue: Callable[[str, dict[int, int]], None] | None = None,
        left_nothing: Callable[[str], None] | None = None,
    ) -> None:
        self.leases = LeaseTable()
        self.oom_exceptions = oom_exceptions
        self.pools = pools
        self.used: set[int] = set()  # devices GPU tasks of this worker held
        self._emit = emit
        self.ledger = ledger  # measures what each task leaves on its devices
        self._residue = residue  # (step or task prefix, bytes it left behind)
        self._left_nothing = left_nothing  # (task prefix): a run seen to leave nothing

    def set_devices(self, indices: list[int], devices: Sequence[DeviceInfo] = ()) -> None:
        """Lease ``indices``; ``devices`` describe them (what requirements are met by)."""
        facts = {
            d.index: DeviceFacts(d.name, d.memory, d.capability, d.mig)
            for d in devices
            if d.index in indices
        }
        self.leases.set_devices(indices, facts if devices else None)

    def gpu_runner(
        self, key: Any, amount: float, prefix: str = "", requirement: Any = None
    ) -> Runner:
        """The runner of a GPU task (made on the event loop; runs in its thread).
        ``requirement``: the task's annotation, as the scheduler normalised it."""
        try:
            need = parse_requirement(requirement) if requirement else None
        except ValueError as exc:  # not read by a scheduler plugin: it errs, unbound never
            return functools.partial(_refuse, exc)
        return functools.partial(self._run_gpu, key, amount, prefix, need)

    def _run_gpu(
        self,
        key: Any,
        amount: float,
        prefix: str,
        requirement: Requirement | None,
        spec: Any,
        values: Any,
    ) -> Any:
        leases = self.leases
        try:
            devices = leases.acquire(key, amount, requirement)
        except NoFreeDevice:
            # its devices were withdrawn (unhealthy) after it was assigned here, or none
            # here meets its requirement: the scheduler places it again
            raise Reschedule() from None
        try:
            self.used.update(devices)
            ledger = self.ledger
            plan = MEASURE if ledger is None else ledger.plan(devices, prefix)
            # marked steps measured inside this task (the attribution names the step)
            steps = None if ledger is None or self._residue is None else _Steps(self, key, devices)
            bound = bind(
                Lease(
                    key,
                    devices,
                    report=self._emit,
                    oom_exceptions=self.oom_exceptions,
                    meter=steps,
                )
            )
            try:
                before = None
                if plan == MEASURE:
                    before, plan = self._opening(key, devices, prefix)
                if plan != MEASURE:
                    assert ledger is not None
                    try:
                        return spec(values)
                    finally:
                        if ledger.unmeasured(devices, prefix, plan):
                            self._nothing(prefix)
                result = spec(values)
                grew = self._measured(key, devices, before, result, steps)
                if grew == 0:
                    self._nothing(prefix)
                if requirement is not None and requirement.memory is not None:
                    self._over_declared(key, devices[0], requirement.memory, grew)
                return result
            finally:
                self.pools.after_gpu_task(devices)
                unbind(bound)
        finally:
            leases.release(key)

    def _measured(
        self,
        key: Any,
        devices: tuple[int, ...],
        before: tuple[Any, dict[int, int]] | None,
        result: Any,
        steps: _Steps | None,
    ) -> int | None:
        """Hold what the task added against its key; attribute what it left behind.
        Returns the bytes it added in all (None: not measured)."""
        if self.ledger is None:
            return None
        token, reading = before if before is not None else (None, None)
        if reading is None or not self.leases.still_alone(key, token):
            for d in devices:  # memory changed unmeasured: no base for arrivals there
                self.ledger.forget(d)
            return None
        left, held = self.ledger.after(key, reading, result), self.ledger.held_by(key)
        if self._residue is not None and not (steps is not None and steps.measured):
            self._residue(key_split(key), left)
        return sum(held.values()) + sum(left.values())

    def _nothing(self, prefix: str) -> None:
        if self._left_nothing is not None:
            self._left_nothing(prefix)

    def _over_declared(self, key: Any, device: int, declared: int, grew: int | None) -> None:
        """A declared-memory task measured (alone on its device) adding more than it
        declared: its neighbours' room was not what the packing counted on."""
        if grew is not None and grew > declared:
            self._emit(
                events.OVER_DECLARED, key=str(key), device=device, declared=declared, measured=grew
            )

    def run_step(self, steps: _Steps, name: str, call: Callable[[], Any]) -> Any:
        """Run one marked step of a task (``steps``' meter), measured when outermost."""
        before = self._measure_before(steps.key, steps.devices) if steps.depth == 0 else None
        steps.depth += 1
        try:
            result = call()
        finally:
            steps.depth -= 1
        if before is not None and self.leases.still_alone(steps.key, before[0]):
            assert self.ledger is not None and self._residue is not None
            steps.measured += 1
            self._residue(name, self.ledger.residue(before[1], result))
        return result

    def _opening(
        self, key: Any, devices: tuple[int, ...], prefix: str
    ) -> tuple[tuple[Any, dict[int, int]] | None, int]:
        """A MEASURE task's (alone token, base) and its plan again: a base reading that
        found no context plans it LEARN or SKIP itself, whatever a leak check dropped
        meanwhile (else the run would be neither measured nor seen to leave nothing)."""
        ledger = self.ledger
        if ledger is None:
            return None, MEASURE
        token = self.leases.alone_token(key)
        if token is None:  # not alone: no base; another task's reading may have found none
            return None, ledger.plan(devices, prefix)
        reading, plan = ledger.opening(devices, prefix)
        return (None if reading is None else (token, reading)), plan

    def _measure_before(
        self, key: Any, devices: tuple[int, ...]
    ) -> tuple[Any, dict[int, int]] | None:
        """(alone token, reading) to measure a marked step by, when its task holds its
        devices alone: the token proves at the end that no other task took or gave back
        one meanwhile (:meth:`_opening` is the same before the task's code runs)."""
        if self.ledger is None:
            return None
        token = self.leases.alone_token(key)
        if token is None:
            return None
        reading = self.ledger.before(devices)
        return None if reading is None else (token, reading)

    @staticmethod
    def fallback_runner(inner: Runner | None) -> Runner:
        """A fallen-back task: its device-array inputs are copied to the host first.

        Only possible on a worker that could receive them, one with CuPy and a GPU;
        elsewhere such inputs cannot even be deserialized (see docs/fallback.md).
        """

        def run(spec: Any, values: dict) -> Any:
            host = {k: to_host(v) for k, v in values.items()}
            return inner(spec, host) if inner is not None else spec(host)

        return run


def send_back(spec: Any, values: dict) -> Any:
    """A GPU task reaching execution on a worker about to restart: placed again."""
    raise Reschedule()


def _refuse(exc: ValueError, spec: Any, values: Any) -> Any:
    raise exc


class _Steps:
    """A GPU task's meter (``Lease.meter``): measures each outermost marked step the task
    calls, so the attribution names the step that left memory behind, even inside a fused
    task. One per task, made only for tasks run with a ledger."""

    __slots__ = ("binder", "key", "devices", "depth", "measured")

    def __init__(self, binder: Binder, key: Any, devices: tuple[int, ...]) -> None:
        self.binder = binder
        self.key = key
        self.devices = devices
        self.depth = 0
        self.measured = 0  # steps measured so far

    def __call__(self, name: str, call: Callable[[], Any]) -> Any:
        return self.binder.run_step(self, name, call)
