"""Per-task device binding on the worker: each GPU task holds its own device(s).

The worker's state machine caps how many GPU tasks run at once (its ``GPU`` resource).
The runners here, called in the task's executor thread, take a lease from the
:class:`~accelsched.binding.LeaseTable`, make the device current for the task
(:func:`accelsched.context.holding`), free pools as the task ends, and give the lease
back whatever happens. A task that fell back to its CPU form gets its device-array
inputs copied to the host first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dask.utils import key_split
from distributed import Reschedule

from accelsched.binding import LeaseTable, NoFreeDevice
from accelsched.context import Lease, holding
from accelsched.devices.arrays import to_host
from accelsched.worker.ledger import Ledger
from accelsched.worker.pools import PoolFreer

__all__ = ["Binder"]

Runner = Callable[[Any, dict], Any]


class Binder:
    """Leases of this worker's granted devices, and the runners that take them."""

    def __init__(
        self,
        *,
        simulated: bool,
        oom_exceptions: tuple[str, ...],
        pools: PoolFreer,
        emit: Callable[..., None],
        ledger: Ledger | None = None,
        residue: Callable[[str, dict[int, int]], None] | None = None,
    ) -> None:
        self.leases = LeaseTable()
        self.simulated = simulated
        self.oom_exceptions = oom_exceptions
        self.pools = pools
        self.used: set[int] = set()  # devices GPU tasks of this worker held
        self._emit = emit
        self.ledger = ledger  # measures what each task leaves on its devices
        self._residue = residue  # (step or task prefix, bytes it left behind)

    def set_devices(self, indices: list[int]) -> None:
        self.leases.set_devices(indices)

    def gpu_runner(self, key: Any, amount: float) -> Runner:
        def run(spec: Any, values: dict) -> Any:
            try:
                devices = self.leases.acquire(key, amount)
            except NoFreeDevice:
                # its devices were withdrawn (unhealthy) after it was assigned here: the
                # scheduler places it again against this worker's lower count
                raise Reschedule() from None
            self.used.update(devices)
            try:
                steps: list[int] = []  # marked steps measured inside this task
                lease = Lease(
                    key,
                    devices,
                    simulated=self.simulated,
                    report=self._emit,
                    oom_exceptions=self.oom_exceptions,
                    meter=self._meter(key, devices, steps),
                )
                with holding(lease):
                    try:
                        before = self._measure_before(key, devices)
                        result = spec(values)
                        self._measured(key, devices, before, result, steps)
                        return result
                    finally:
                        self.pools.after_gpu_task(devices)
            finally:
                self.leases.release(key)

        return run

    def _measured(
        self,
        key: Any,
        devices: tuple[int, ...],
        before: tuple[Any, dict[int, int]] | None,
        result: Any,
        steps: list[int],
    ) -> None:
        """Hold what the task added against its key; attribute what it left behind."""
        if self.ledger is None:
            return
        token, reading = before if before is not None else (None, None)
        if reading is None or not self.leases.still_alone(key, token):
            for d in devices:  # memory changed unmeasured: no base for arrivals there
                self.ledger.forget(d)
            return
        left = self.ledger.after(key, reading, result)
        if self._residue is not None and not steps:
            self._residue(key_split(key), left)

    def _meter(
        self, key: Any, devices: tuple[int, ...], steps: list[int]
    ) -> Callable[[str, Callable[[], Any]], Any] | None:
        """Measures each outermost marked step the task calls: the attribution names the
        step that left memory behind, even inside a fused task."""
        if self.ledger is None or self._residue is None:
            return None
        depth = [0]

        def meter(name: str, call: Callable[[], Any]) -> Any:
            before = self._measure_before(key, devices) if depth[0] == 0 else None
            depth[0] += 1
            try:
                result = call()
            finally:
                depth[0] -= 1
            if before is not None and self.leases.still_alone(key, before[0]):
                assert self.ledger is not None and self._residue is not None
                steps.append(1)
                self._residue(name, self.ledger.residue(before[1], result))
            return result

        return meter

    def _measure_before(
        self, key: Any, devices: tuple[int, ...]
    ) -> tuple[Any, dict[int, int]] | None:
        """(alone token, reading) to measure the task by, when it holds its devices alone:
        the token proves at the end that no other task took or gave back one meanwhile."""
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
