"""Per-task device binding on the worker: each GPU task holds its own device(s); tasks
that asked for none are watched for GPU use; pools are freed after GPU tasks.

**Binding** (:class:`Binder`). The worker's state machine caps how many GPU tasks run at
once (its ``GPU`` resource). The runners here, called in the task's executor thread, take
a lease the :class:`~accelsched.policy.requirements.LeaseTable` grants (waiting there while it
has no room), make the device current for the task (:func:`accelsched.context.holding`),
free pools as the task ends, and give the lease back whatever happens. A task that fell
back to its CPU form gets its device-array inputs copied to the host first.

**Freeing pools** (:class:`PoolFreer`). Pools cache freed blocks so the next allocation
is cheap; the cache looks like used memory to NVML and to other processes. Every
``free_pools_every`` GPU tasks, when the pools cache at least ``free_pools_min`` on a
device the task held (and, with ``free_pools_above``, only when such a device is fuller
than that fraction), the pools of :mod:`accelsched.devices.gpu_memory` give back what
they cache, device by device. Freeing a near-empty pool after each of thousands of tiny
tasks would cost more than it returns.

**Watching tasks that asked for no GPU** (:class:`Watch`): did they use one anyway?
Device memory is read per process, so a task's growth can be blamed on it only when it
ran alone: each worker's :class:`~accelsched.policy.requirements.LeaseTable` records the tasks
running in its threads (the guard's transition hook feeds it, so unwatched tasks count
too), and a watched task's readings count only when no other task of any worker in the
process started or ended while it ran. :func:`accelsched.policy.leak.classify` decides
what the readings mean. Reading NVML costs tens of microseconds per device, twice per
task: on a worker that sees 8 GPUs that is more than a tiny task itself. Using a GPU is a
property of the code a task runs, so the watch samples per task prefix: the first
:data:`FIRST_RUNS` runs of each prefix on each worker, then one run in :data:`EVERY`.
With ``unrequested_gpu="fail"`` every task is watched, since a task that uses a GPU must
then fail, not a later one.
"""

from __future__ import annotations

import functools
import itertools
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from distributed import Reschedule

from accelsched import events
from accelsched.context import Lease, bind, unbind, using_device
from accelsched.devices.gpu_memory import DevicePool, MemoryCap, active_pools, to_host
from accelsched.devices.nvml import DeviceInfo, MemoryReading, NVMLMonitor
from accelsched.policy.leak import classify
from accelsched.policy.requirements import (
    Cancelled,
    LeaseTable,
    NoFreeDevice,
    Requirement,
    parse_requirement,
)
from accelsched.protocol import FALLBACK_ANNOTATION, GPU, GPU_MEMORY, REQUIREMENT_ANNOTATION
from accelsched.worker.leak_check import Ledger, Meter

__all__ = [
    "Binder",
    "EVERY",
    "FIRST_RUNS",
    "PoolFreer",
    "TABLES",
    "UnrequestedGPUUse",
    "Watch",
    "send_back",
]


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


#: Runs of each task prefix watched before sampling starts.
FIRST_RUNS = 4
#: After that, one run in this many is watched.
EVERY = 64
#: Prefixes remembered per worker; beyond this the counts start over (names made per
#: task must not grow memory forever).
MAX_PREFIXES = 10_000


class UnrequestedGPUUse(RuntimeError):
    """A task that did not ask for a GPU used one (``unrequested_gpu="fail"``)."""


#: Every worker's record of what runs in its threads, in this process (the guards add
#: theirs at setup): device memory is read per process, so a task ran alone only when no
#: task of any of them ran beside it.
TABLES: weakref.WeakSet[LeaseTable] = weakref.WeakSet()


def _changes() -> tuple[int, int]:
    """Tasks started or ended so far in this process, and tasks running now: a task ran
    alone when it was the only one running at its start and the first count is the same
    at its end."""
    tables = list(TABLES)  # a copy: a table may be collected meanwhile
    return sum(t.changes for t in tables), sum(t.running() for t in tables)


class Watch:
    """Reads this process's device memory around unannotated tasks that ran alone."""

    def __init__(
        self,
        *,
        monitor: NVMLMonitor,
        visible: list[DeviceInfo],
        fail: bool,
        emit: Callable[..., None],
    ) -> None:
        self.monitor = monitor
        self.visible = visible
        self.fail = fail
        self._emit = emit
        self._runs: dict[str, int] = {}  # prefix -> runs seen on this worker

    def sampled(self, prefix: str) -> bool:
        """Whether this run of ``prefix`` is watched (event loop)."""
        if self.fail:
            return True
        n = self._runs.get(prefix, 0) + 1
        if n == 1 and len(self._runs) >= MAX_PREFIXES:
            self._runs.clear()
        self._runs[prefix] = n
        return n <= FIRST_RUNS or n % EVERY == 0

    def runner(self, key: Any) -> Runner:
        def run(spec: Any, values: dict) -> Any:
            changes, running = _changes()
            before = self._readings() if running <= 1 else None
            result = spec(values)
            if before is None or _changes()[0] != changes:  # another task ran meanwhile
                return result
            for use in classify(before, self._readings()):
                self._emit(
                    events.UNREQUESTED_GPU_USE,
                    key=key,
                    device=use.device,
                    nbytes=use.nbytes,
                    context_created=use.context_created,
                    failed=self.fail,
                )
                if self.fail:
                    raise UnrequestedGPUUse(
                        f"task {key!r} did not ask for a GPU but used device {use.device} "
                        f"({'created a CUDA context, ' if use.context_created else ''}"
                        f"device memory grew by {use.nbytes} bytes); annotate it with "
                        f"dask.annotate(resources={{'GPU': 1}})"
                    )
            return result

        return run

    def _readings(self) -> dict[int, MemoryReading]:
        """This process's memory on each device that answers NVML (a failing device is
        the leak check's business, never the task's)."""
        out = {}
        for d in self.visible:
            try:
                out[d.index] = self.monitor.process_memory(d.index)
            except Exception:
                continue
        return out


def caches_enough(pools: list[DevicePool], devices: tuple[int, ...], minimum: int) -> bool:
    """Whether the pools cache at least ``minimum`` bytes on one of ``devices``: freeing
    less is not worth a task's time. RMM owning the device pool (a fixed reserve that
    never shrinks) has no figure to wait for (CuPy's pinned host pool can be freed)."""
    try:
        per_device = [[pool.stats(device) for pool in pools] for device in devices]
    except Exception:  # a pool that cannot say: free, as before
        return True
    return any(
        any(s.fixed for s in stats) or sum(s.cached for s in stats) >= minimum
        for stats in per_device
    )


class PoolFreer:
    """Called in a GPU task's thread as it ends, with the devices it held."""

    def __init__(
        self,
        *,
        every: int,
        above: float,
        monitor: NVMLMonitor,
        minimum: int = 0,
    ) -> None:
        self.every = every
        self.above = above
        self.minimum = minimum
        self.monitor = monitor
        self._count = itertools.count(1)  # next() is atomic across threads

    def after_gpu_task(self, devices: tuple[int, ...]) -> None:
        if not self.every or next(self._count) % self.every:
            return
        if not (pools := active_pools()):
            return
        if self.minimum > 0 and not caches_enough(pools, devices, self.minimum):
            return
        if self.above > 0:
            try:
                fractions = [self.monitor.used(d) / self.monitor.device(d).memory for d in devices]
            except Exception:  # NVML does not answer: free anyway, never fail the task
                fractions = [1.0]
            if max(fractions, default=0) <= self.above:
                return
        for device in devices:  # CuPy frees the current device's pool: each is visited
            with using_device(device):
                for pool in pools:
                    pool.free_all()
