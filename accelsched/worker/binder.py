"""Per-task device binding on the worker: each GPU task holds its own device(s).

The worker's state machine caps how many GPU tasks run at once (its ``GPU`` resource).
The runners here, called in the task's executor thread, take a lease the
:class:`~accelsched.policy.leases.LeaseTable` grants (waiting there while it has no
room), make the device current for the task
(:func:`accelsched.context.holding`), free pools as the task ends, and give the lease
back whatever happens. A task that fell back to its CPU form gets its device-array
inputs copied to the host first.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from distributed import Reschedule

from accelsched import events
from accelsched.context import Lease, bind, unbind
from accelsched.devices.gpu_memory import MemoryCap, to_host
from accelsched.devices.nvml import DeviceInfo
from accelsched.policy.leases import Cancelled, LeaseTable, NoFreeDevice
from accelsched.policy.requirements import Requirement, parse_requirement
from accelsched.protocol import FALLBACK_ANNOTATION, GPU, GPU_MEMORY, REQUIREMENT_ANNOTATION
from accelsched.worker.ledger import Ledger, Meter
from accelsched.worker.pool_freer import PoolFreer
from accelsched.worker.watch import Watch

__all__ = ["Binder", "send_back"]

Runner = Callable[[Any, dict], Any]

#: Seconds a waiting task sleeps between looks when no lease ends meanwhile.
WAIT_SLICE = 1.0


class Binder:
    """Leases of this worker's granted devices, and the runners that take them."""

    def __init__(
        self,
        *,
        oom_exceptions: tuple[str, ...],
        enforce_memory: bool = False,
        pools: PoolFreer,
        emit: Callable[..., None],
        ledger: Ledger | None = None,
    ) -> None:
        # what runs in this worker's threads, and holds what; room is net of results held
        self.leases = LeaseTable(held=None if ledger is None else ledger.live)
        self.watch: Watch | None = None  # tasks that asked for no GPU, watched for use
        self._freed = threading.Condition()  # a lease ended, or the devices changed
        self._waiting = 0  # tasks waiting for room
        self.oom_exceptions = oom_exceptions
        self.enforce_memory = enforce_memory  # a step's own enforce= wins
        self.pools = pools
        self.used: set[int] = set()  # devices GPU tasks of this worker held
        self._emit = emit
        self.ledger = ledger  # measures what each task leaves on its devices

    def set_devices(
        self,
        indices: list[int],
        devices: Sequence[DeviceInfo] = (),
        shares: Mapping[int, int] | None = None,
    ) -> None:
        """Lease ``indices``; ``devices`` describe them (what requirements are met by);
        ``shares``: what declared tasks may take of each (a device shared with others)."""
        facts = {d.index: d for d in devices if d.index in indices}
        self.leases.set_devices(indices, facts if devices else None, shares)
        self.room_freed()

    def room_freed(self) -> None:
        """A waiting task may fit now (a device offered, a result released)."""
        with self._freed:
            self._freed.notify_all()

    def route(
        self,
        key: Any,
        resources: Mapping[str, float],
        annotations: Mapping[str, Any],
        prefix: str,
        *,
        granted: bool,
        draining: bool,
    ) -> Runner | None:
        """The runner for a task starting to execute (event loop), or None to leave it:
        a GPU task takes a lease (``granted``: this worker has devices; ``draining``: it
        restarts, the scheduler places the task elsewhere), a fallen-back one gets its
        inputs on the host, another may be watched for GPU use."""
        amount = resources.get(GPU, 0)
        if amount > 0 or resources.get(GPU_MEMORY, 0) > 0:
            self.leases.asks_gpu(key)
            if granted:
                return (
                    send_back
                    if draining
                    else self.gpu_runner(
                        key, amount, prefix, annotations.get(REQUIREMENT_ANNOTATION)
                    )
                )
        watch = self.watch
        runner = watch.runner(key) if watch is not None and watch.sampled(prefix) else None
        if annotations.get(FALLBACK_ANNOTATION):
            return self.fallback_runner(runner)
        return runner

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
            devices = leases.grant(key, amount, requirement)
            if devices is None:  # no room now: wait, in this thread, for a lease to end
                with self._freed:
                    self._waiting += 1  # before it looks again: a release then notifies
                    try:
                        while (devices := leases.grant(key, amount, requirement)) is None:
                            self._freed.wait(WAIT_SLICE)
                    finally:
                        self._waiting -= 1
        except NoFreeDevice:
            # its devices were withdrawn (unhealthy) after it was assigned here, or none
            # here meets its requirement: the scheduler places it again
            raise Reschedule() from None
        except Cancelled:
            # nobody wants it now (its result would be dropped): it stops waiting, and
            # its claim goes with it; wanted again, the scheduler places it again
            leases.release(key)
            raise Reschedule() from None
        try:
            self.used.update(devices)
            ledger = self.ledger
            declared = None if requirement is None else requirement.memory
            meter = (
                None
                if ledger is None
                # what a task that declared its memory adds is held to it: measured always
                else Meter(ledger, leases, key, devices, prefix, sample=declared is None)
            )
            cap = None
            if requirement is not None and declared is not None:
                enforce = requirement.enforce
                cap = MemoryCap(
                    str(key), declared, enforce=self.enforce_memory if enforce is None else enforce
                )
            bound = bind(
                Lease(
                    key,
                    devices,
                    report=self._emit,
                    oom_exceptions=self.oom_exceptions,
                    meter=meter,
                    cap=cap,
                )
            )
            try:
                result = spec(values) if meter is None else meter.run(spec, values)
                # what it held at its peak, packed or alone, or (measured alone on its
                # device) added: more than it declared, its neighbours' room was not what
                # the packing counted on
                measured = max(0 if cap is None else cap.peak, (meter and meter.grew) or 0)
                if declared is not None and measured > declared:
                    self._emit(
                        events.OVER_DECLARED,
                        key=str(key),
                        device=devices[0],
                        declared=declared,
                        measured=measured,
                    )
                return result
            finally:
                self.pools.after_gpu_task(devices)
                unbind(bound)
        finally:
            leases.release(key)
            if self._waiting:
                with self._freed:
                    self._freed.notify_all()

    def cancelled(self, key: Any) -> None:
        """``key`` was cancelled while its function runs (event loop): if it waits for a
        lease, its thread stops waiting now rather than run it once a device is free."""
        if self.leases.cancel(key):
            with self._freed:
                self._freed.notify_all()

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
