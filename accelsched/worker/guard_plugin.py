"""GuardPlugin: the worker side of accelsched, wiring hooks to its parts.

The parts (``accelsched/worker/``; the per-task ones, which run in each task's thread, here):

- :class:`~accelsched.worker.leak_check.Inventory`: probe the devices through NVML, report
  them to the PlacementPlugin, advertise what it granted; ask for this worker's restart.
- :class:`Binder`: give each running GPU task its own device,
  current in its thread; free pools after GPU tasks
  (:class:`PoolFreer`).
- :class:`Watch`: notice a task that did not ask for a GPU but
  created a CUDA context or grew this process's device memory.
- :class:`~accelsched.worker.leak_check.LeakCheck`: every ``check_interval``, read the
  devices through NVML and estimate device memory nothing legitimate holds
  (:class:`~accelsched.worker.leak_check.Ledger` says what results hold); on a
  confirmed leak, ask for a lossless restart. Its heartbeat metric carries what only the
  worker knows to ``accelsched status``.
- :class:`~accelsched.worker.leak_check.WorkerActor`: carries out what those decisions propose
  (events, withdrawals, reclaims, restart requests), the one place that acts on them; asks
  NVML again, with backoff, about the devices left out of the inventory and reports each
  back once it answers steadily.

The plugin itself checks at setup that the distributed internals the parts rely on are
there (:mod:`accelsched.internals`) and routes each task as it starts executing. What it
says to the scheduler is in :mod:`accelsched.protocol`.

**Preimport** (:func:`preimport`): modules a worker imports whole before its first task.

Python imports a package's modules under per-module locks, and when two threads import
parts of one package whose modules import each other (``dask.dataframe`` and
``dask.dataframe.dask_expr`` do), the import system breaks the cycle by handing one
thread a partially initialised module: ``ImportError: cannot import name 'DataFrame'
from partially initialized module 'dask.dataframe.dask_expr'`` (or ``_DeadlockError``).
A worker meets that when its first DataFrame work arrives as several tasks at once,
which is what a CPU worker beside GPU workers sees when a batch of GPU tasks falls back
to it together; raised where the worker reads a task message rather than inside a task,
it closes the worker (distributed's ``fail_hard``), and the nanny with it.

The guard imports these modules in its ``setup``, on the worker's event loop: a worker
reads no task message before its plugins are set up, so no task thread can be importing
at that moment and each module is whole before the first task runs. A module that is
not installed (``dask.dataframe`` without pandas) is skipped.

**Binding** (:class:`Binder`). The worker's state machine caps how many GPU tasks run at
once (its ``GPU`` resource). The runners here, called in the task's executor thread, take
a lease the :class:`~accelsched.policy.requirements.LeaseTable` grants (waiting there while it
has no room), make the device current for the task (:func:`accelsched.context.bind`),
free pools as the task ends, and give the lease back whatever happens. A task that fell
back to its CPU form gets its device-array inputs copied to the host first.

**Freeing pools** (:class:`PoolFreer`). Pools cache freed blocks so the next allocation
is cheap; the cache looks like used memory to NVML and to other processes. Every
``free_pools_every`` GPU tasks, when the pools cache at least ``free_pools_min`` on a
device the task held (and, with ``free_pools_above``, only when such a device is fuller
than that fraction), the pools of :mod:`accelsched.devices` give back what
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
import importlib
import itertools
import logging
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from dask.utils import key_split
from distributed import Reschedule
from distributed.diagnostics.plugin import WorkerPlugin

from accelsched import events, internals
from accelsched.config import GUARD_OPTIONS, guard_options_here, resolve_options
from accelsched.context import bind, lease_of, unbind, using_device
from accelsched.devices import (
    POOLS,
    DeviceInfo,
    DevicePool,
    MemoryCap,
    MemoryReading,
    NVMLMonitor,
    active_pools,
    cuda,
    to_host,
)
from accelsched.policy.leak import MAX_PREFIXES, Attribution, LeakDecisions, Verdict, classify
from accelsched.policy.requirements import (
    Cancelled,
    LeaseTable,
    NoFreeDevice,
    Requirement,
    parse_requirement,
)
from accelsched.protocol import (
    DRAIN_HANDLER,
    FALLBACK_ANNOTATION,
    GPU,
    GPU_MEMORY,
    GUARD_METRIC,
    GUARD_PLUGIN,
    REPORT_HANDLER,
    REQUIREMENT_ANNOTATION,
    ReportReply,
)
from accelsched.worker.leak_check import Inventory, LeakCheck, Ledger, Meter, WorkerActor

if TYPE_CHECKING:
    from distributed import Worker

__all__ = [
    "Binder",
    "EVERY",
    "FIRST_RUNS",
    "GuardPlugin",
    "PoolFreer",
    "TABLES",
    "UnrequestedGPUUse",
    "Watch",
    "preimport",
    "send_back",
]

logger = logging.getLogger(__name__)


_PERIODIC = "accelsched-guard"
_RUNNING = frozenset({"executing", "long-running"})
_THREADED = _RUNNING | {"cancelled", "resumed"}


class GuardPlugin(WorkerPlugin):
    """Verified inventory, per-task device binding, unrequested-use watch, leak check.

    Options (each also dask config under ``accelsched.guard.``, see
    ``docs/configuration.md``) are validated here, on the client.
    """

    name = GUARD_PLUGIN
    # the worker and the parts (set up once the devices are known, in setup)
    #: the inventory's visible devices once set up (kept up to date in place): with none,
    #: transitions are not routed
    _visible: Sequence[DeviceInfo] = ()

    def __init__(self, **options: Any) -> None:
        self.options = resolve_options(GUARD_OPTIONS, options, type(self).__name__)
        # given, not from config: a worker's own yields. These two (and ``idempotent``,
        # which register() sets) are all it pickles: its parts are made at setup, on the
        # worker
        self.explicit = frozenset(options)

    # --- WorkerPlugin hooks -------------------------------------------------------------

    async def setup(self, worker: Worker) -> None:
        """Check distributed's internals, probe devices, report them, advertise the grant.

        Worker plugins run after the worker registered, so its declared ``GPU`` count is
        already known to the scheduler; the PlacementPlugin ignores it until this report.
        Raises :class:`~accelsched.internals.IncompatibleDistributed`, which fails
        ``client.register_plugin``, when distributed changed what accelsched relies on.
        """
        internals.check_worker(worker)
        self.worker = worker
        # this worker's own settings, where no explicit option says otherwise (logged)
        o = self.options = guard_options_here(self.options, self.explicit, worker)
        preimport(o["preimport"])  # before this worker reads its first task
        inv = self.inventory = Inventory(
            worker, advertise_undeclared=o["advertise_undeclared"], interval=o["check_interval"]
        )
        attribution = Attribution()
        ledger = self.ledger = Ledger(
            inv.monitor,
            residue=attribution.record,  # what each run left behind, by step
            left_nothing=attribution.left_nothing,
            stored=internals.stored_values(worker),
            idle=lambda: {d.index for d in inv.owned} - self.binder.leases.busy(),
            in_memory=internals.in_memory(worker),
        )
        inv.held = ledger.live  # offered room is net of what results hold
        self.binder = Binder(
            oom_exceptions=o["oom_exceptions"],
            enforce_memory=o["enforce_memory"],
            pools=PoolFreer(
                every=o["free_pools_every"],
                above=o["free_pools_above"],
                minimum=o["free_pools_min"],
                monitor=inv.monitor,
            ),
            emit=self._emit,
            ledger=ledger,
            watch=None
            if o["unrequested_gpu"] == "ignore"
            else Watch(
                monitor=inv.monitor,
                visible=inv.visible,
                fail=o["unrequested_gpu"] == "fail",
                emit=self._emit,
            ),
        )
        inv.leased = self.binder.leases.declared  # what its offers say it takes
        left_out = o["recover_gpus"] and bool(inv.monitor.left_out)
        actor = WorkerActor(
            inventory=inv,
            set_devices=self._use_devices,
            emit=self._emit,
            spawn=lambda fn, *args: internals.spawn(worker, fn, *args),
            report=self.report if left_out else None,
        )
        self.leaks = LeakCheck(
            inventory=inv,
            leases=self.binder.leases,
            used=self.binder.used,
            ledger=ledger,
            actor=actor,
            decisions=LeakDecisions(
                o["leak_confirmations"],
                o["restart_on_leak"],
                attribution,
                devices=inv.health.devices,  # one record per device
            ),
            threshold=o["leak_threshold"],
            recover=o["recover_gpus"],
        )
        self._visible, self.rejoin = inv.visible, actor if left_out else None
        internals.add_metric(worker, GUARD_METRIC, self.leaks.heartbeat_metric)
        TABLES.add(self.binder.leases)
        if inv.visible:  # as the transition hook, which alone uncounts them
            # registered again (a new GuardPlugin replaces the old one, whose teardown
            # stopped counting its tasks): what runs now still shares the process
            for key, gpu in internals.tasks_in_threads(worker).items():
                self.binder.leases.started(key, gpu=gpu)
        internals.install_handler(worker, REPORT_HANDLER, self.report)
        internals.install_handler(worker, DRAIN_HANDLER, inv.drain)
        if internals.serving(worker):
            await self.report()
        else:
            # Set up while the worker starts: it answers no RPC (the scheduler's
            # calls included) until this returns, so report right after.
            internals.spawn(worker, self.report)
        if inv.visible or self.rejoin is not None:  # (a guard it replaces stopped its own)
            internals.start_periodic(worker, _PERIODIC, self.check, o["check_interval"])

    async def teardown(self, worker: Worker) -> None:
        """Unregistered: remove the report handler and stop the leak check. A worker that
        closes keeps the handler, which answers ``closing``: the scheduler may not know yet
        that it closes, and asks (distributed logs a traceback for a missing handler)."""
        if not internals.worker_closing(worker):
            internals.remove_handler(worker, REPORT_HANDLER, self.report)
        internals.stop_periodic(worker, _PERIODIC)
        if not hasattr(self, "leaks"):
            return  # set up no further than the check of distributed's internals
        internals.remove_handler(worker, DRAIN_HANDLER, self.inventory.drain)
        TABLES.discard(self.binder.leases)  # what it counted no longer runs under this guard
        internals.remove_metric(worker, GUARD_METRIC, self.leaks.heartbeat_metric)
        if not internals.worker_closing(worker):
            # the scheduler learns now that no guard answers here: a placement plugin
            # unregistered right after (docs: to change options) asks no report of it
            await internals.heartbeat_now(worker)

    def transition(self, key: Any, start: str, finish: str, **kwargs: Any) -> None:
        """Track live results; route a task starting to execute (worker event loop).

        GPU tasks get a device lease; fallen-back tasks get their inputs on the host;
        other tasks are watched for GPU use. The wrapping itself is O(1); the work
        happens in the task's thread. Every transition of every task passes here.
        """
        if not self._visible:
            return
        if finish in _RUNNING:  # a function starts running in a thread (every task counts)
            running = self.binder.leases
            running.started(key)
            if start == "cancelled":  # wanted again while its thread ran on
                running.resume(key)
            if finish == "executing":
                prefix = key_split(key)
                self.leaks.ran(prefix)
                internals.wrap_execution(self.worker, key, self._choose, prefix)
            return
        if finish == "memory":
            computed = start in _RUNNING  # here: its function has returned
            if self.ledger.entered(key, computed=computed):
                self._results_moved()
            if computed:
                self._ended(key)
                return
        elif (start == "memory" or finish == "forgotten") and self.ledger.released(key):
            self.binder.room_freed()
            self._results_moved()
        elif finish == "flight":  # its data is about to come from a peer
            self.ledger.fetching()
        # started or ended, as its thread says (cancelled runs on); only a task coming
        # from a thread's states can be running in one (the common transitions stop here)
        if start not in _THREADED or key not in (running := self.binder.leases):
            return
        if start in _RUNNING and finish == "released":  # cancelled: its thread runs on
            # if it waits for a lease, its thread stops waiting now rather than run it
            # once a device is free
            if running.cancel(key):
                self.binder.room_freed()
        elif start == "cancelled":  # wanted again, or its thread is done
            running.resume(key)
        if internals.runs_in_thread(self.worker, key):
            running.started(key)
        else:
            self._ended(key)

    def _choose(
        self, key: Any, resources: Mapping[str, float], annotations: Mapping[str, Any], prefix: str
    ) -> Runner | None:
        """The runner of a task of ``prefix`` starting to execute (:meth:`Binder.route`)."""
        inv = self.inventory
        return self.binder.route(
            key, resources, annotations, prefix, granted=bool(inv.granted), draining=inv.draining
        )

    def _ended(self, key: Any) -> None:
        """A task's function returned: if a check skipped its busy devices, judge them now,
        before the next task takes them (back-to-back GPU tasks hold them nearly always).
        If tasks packed under a larger share ran on, its end may give room back to a
        worker sharing the device."""
        if self.binder.leases.ended(key):
            if self.leaks.owed:
                self.leaks.check()
            if self.inventory.over:
                self.inventory.let_go(self._use_devices)

    def _results_moved(self) -> None:
        """Results took or gave back device memory: offered again once the room they
        leave moved by a step (so the scheduler places what fits, and sends back what no
        longer does), not at every result."""
        inv = self.inventory
        if inv.granted and (steps := inv.held_in_steps()) != inv.held_said:
            inv.held_said = steps  # one offer per step moved, not per result
            internals.spawn(self.worker, inv.offer, self._use_devices)

    async def report(self) -> ReportReply:
        """Report the owned devices to the scheduler and advertise what it granted (an
        RPC handler: a method, as distributed logs each handler's ``__name__``). A worker
        closing reports nothing: its connections to the scheduler are going."""
        if internals.worker_closing(self.worker):
            return {"status": "closing"}
        try:
            return await self.inventory.report(self._use_devices)
        except Exception:
            if internals.worker_closing(self.worker):  # it began closing meanwhile
                return {"status": "closing"}
            raise

    def _use_devices(self, usable: list[int]) -> None:
        """Lease these devices, described as NVML verified them (for requirements)."""
        inv = self.inventory
        self.binder.set_devices(usable, inv.granted, inv.shares_of(usable))

    def check(self) -> list[Verdict]:
        """One leak check now (the periodic callback, every ``check_interval``). The
        next GPU task on each device reads NVML again: what the ledger knew of a device
        without a context (no reading to measure by) is forgotten at each check."""
        if self.rejoin is not None:
            self.rejoin.rejoin()
        self.ledger.recheck()
        return self.leaks.check()

    def _emit(self, action: str, **figures: Any) -> None:
        """Send an event to the scheduler's log (from any thread)."""
        msg = events.event(action, self.worker.contact_address, **figures)
        logger.log(*events.log_line(msg))
        self.worker.log_event(events.TOPIC, msg)


def preimport(modules: tuple[str, ...]) -> None:
    """Import ``modules``, skipping (logged) those not installed or failing."""
    for name in modules:
        start = time.perf_counter()
        try:
            importlib.import_module(name)
        except ImportError as exc:  # not installed here (or a dependency is not)
            logger.info("accelsched: preimport %s skipped: %s", name, exc)
        except Exception as exc:  # a module that fails to import costs its guard nothing
            logger.warning("accelsched: preimport %s failed: %r", name, exc)
        else:
            logger.debug("accelsched: preimported %s in %.2f s", name, time.perf_counter() - start)


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
        watch: Watch | None = None,
    ) -> None:
        # what runs in this worker's threads, and holds what; room is net of results held
        self.leases = LeaseTable(held=None if ledger is None else ledger.live)
        self.watch = watch  # tasks that asked for no GPU, watched for use
        self._freed = threading.Condition()  # a lease ended, or the devices changed
        self._waiting = 0  # tasks waiting for room
        self.oom_exceptions = oom_exceptions
        self.enforce_memory = enforce_memory  # a step's own enforce= wins
        self.pools = pools
        self.used: set[int] = set()  # devices GPU tasks of this worker held
        self._emit = emit
        self.ledger = ledger  # measures what each task leaves on its devices
        self.cuda = cuda()  # the backend's, once: not looked up again per task

    def set_devices(
        self,
        indices: list[int],
        devices: Sequence[DeviceInfo] = (),
        shares: Mapping[int, int] | None = None,
    ) -> None:
        """Lease ``indices``; ``devices`` describe them (what requirements are met by);
        ``shares``: what declared tasks may take of each (a device shared with others)."""
        # (the table reads the facts of the devices it leases only)
        self.leases.set_devices(indices, {d.index: d for d in devices} or None, shares)
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
        if not annotations.get(FALLBACK_ANNOTATION):
            return runner

        def fallen_back(spec: Any, values: dict) -> Any:
            # Its device-array inputs are copied to the host first. Only possible on a
            # worker that could receive them, one with CuPy and a GPU; elsewhere such
            # inputs cannot even be deserialized (see docs/fallback.md).
            host = {k: to_host(v) for k, v in values.items()}
            return runner(spec, host) if runner is not None else spec(host)

        return fallen_back

    def gpu_runner(
        self, key: Any, amount: float, prefix: str = "", requirement: Any = None
    ) -> Runner:
        """The runner of a GPU task (made on the event loop; runs in its thread).
        ``requirement``: the task's annotation, as the scheduler normalised it."""
        try:
            need = parse_requirement(requirement) if requirement else None
        except ValueError as exc:  # not read by a scheduler plugin: it errs, unbound never
            return functools.partial(_refuse, exc)
        if amount <= 0 and (need is None or need.memory is None):
            # GPU-memory named by hand (no scheduler plugin read it): bytes, no device
            return functools.partial(_refuse, ValueError(_NO_DEVICE_ASKED))
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
        except (NoFreeDevice, Cancelled):
            # its devices were withdrawn (unhealthy) after it was assigned here, none
            # here meets its requirement, or nobody wants it now (cancelled while it
            # waited: its result would be dropped): it stops waiting, and what it claimed
            # goes with it; the scheduler places it again (wanted again, if cancelled)
            leases.release(key)
            raise Reschedule() from None
        try:
            self.used.update(devices)
            declared = None if requirement is None else requirement.memory
            meter = (
                None
                if self.ledger is None
                # what a task that declared its memory adds is held to it: measured always
                else Meter(self.ledger, leases, key, devices, prefix, sample=declared is None)
            )
            cap = (
                None
                if requirement is None or declared is None
                else MemoryCap(
                    str(key),
                    declared,
                    enforce=(
                        self.enforce_memory if requirement.enforce is None else requirement.enforce
                    ),
                )
            )
            bound = bind(
                lease_of(key, devices, self._emit, self.oom_exceptions, meter, cap, self.cuda)
            )
            try:
                result = spec(values) if meter is None else meter.run(spec, values)
                if cap is not None:  # (declared: so is its cap)
                    # what it held at its peak, packed or alone, or (measured alone on its
                    # device) added: more than it declared, its neighbours' room was not
                    # what the packing counted on
                    measured = max(cap.peak, (meter and meter.grew) or 0)
                    if measured > cap.declared:
                        self._emit(
                            events.OVER_DECLARED,
                            key=str(key),
                            device=devices[0],
                            declared=cap.declared,
                            measured=measured,
                        )
                return result
            finally:
                self.pools.after_gpu_task(devices)
                unbind(bound)
        finally:
            leases.release(key)
            if self._waiting:
                self.room_freed()


_NO_DEVICE_ASKED = (
    f"resources={{{GPU_MEMORY!r}: ...}} without {GPU!r}: accelsched's own resource; declare "
    "a task's device memory with gpu={'memory': ...} beside resources={'GPU': 1}"
)


def send_back(spec: Any, values: dict) -> Any:
    """A GPU task reaching execution on a worker about to restart: placed again."""
    raise Reschedule()


def _refuse(exc: ValueError, spec: Any, values: Any) -> Any:
    raise exc


#: Runs of each task prefix watched before sampling starts.
FIRST_RUNS = 4
#: After that, one run in this many is watched.
EVERY = 64


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
    """Whether the active ones of ``pools`` cache at least ``minimum`` bytes on one of
    ``devices``: freeing less is not worth a task's time. RMM owning the device pool (a
    fixed reserve that never shrinks) has no figure to wait for (CuPy's pinned host pool
    can be freed)."""
    try:
        for device in devices:  # (loops, no list of the active pools: after every GPU task)
            cached = 0
            for pool in pools:
                if not pool.active():
                    continue
                stats = pool.stats(device)
                if stats.fixed:
                    return True
                cached += stats.cached
            if cached >= minimum:
                return True
    except Exception:  # a pool that cannot say: free, as before
        return True
    return False


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
        if (
            not self.every
            or next(self._count) % self.every
            # (the common case: nothing worth freeing, asked of every pool in one pass)
            or (self.minimum > 0 and not caches_enough(POOLS, devices, self.minimum))
            or not (pools := active_pools())
        ):
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
