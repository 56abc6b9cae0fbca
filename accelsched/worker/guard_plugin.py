"""GuardPlugin: the worker side of accelsched, wiring hooks to its parts.

The parts (``accelsched/worker/``):

- :class:`~accelsched.worker.leak_check.Inventory`: probe the devices through NVML, report
  them to the PlacementPlugin, advertise what it granted; ask for this worker's restart.
- :class:`~accelsched.worker.binder.Binder`: give each running GPU task its own device,
  current in its thread; free pools after GPU tasks
  (:class:`~accelsched.worker.binder.PoolFreer`).
- :class:`~accelsched.worker.binder.Watch`: notice a task that did not ask for a GPU but
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
"""

from __future__ import annotations

import functools
import importlib
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from dask.utils import key_split
from distributed.diagnostics.plugin import WorkerPlugin

from accelsched import events, internals
from accelsched.config import GUARD_OPTIONS, guard_options_here, resolve_options
from accelsched.devices.nvml import DeviceInfo
from accelsched.policy.leak import Attribution, LeakDecisions, Verdict
from accelsched.protocol import (
    DRAIN_HANDLER,
    GUARD_METRIC,
    GUARD_PLUGIN,
    REPORT_HANDLER,
    ReportReply,
)
from accelsched.worker.binder import TABLES, Binder, PoolFreer, UnrequestedGPUUse, Watch
from accelsched.worker.leak_check import Inventory, LeakCheck, Ledger, WorkerActor

if TYPE_CHECKING:
    from distributed import Worker

__all__ = ["GuardPlugin", "UnrequestedGPUUse", "preimport"]

logger = logging.getLogger(__name__)


_PERIODIC = "accelsched-guard"
_RUNNING = frozenset({"executing", "long-running"})


class GuardPlugin(WorkerPlugin):
    """Verified inventory, per-task device binding, unrequested-use watch, leak check.

    Options (each also dask config under ``accelsched.guard.``, see
    ``docs/configuration.md``) are validated here, on the client.
    """

    name = GUARD_PLUGIN
    # the worker and the parts, set at setup once the devices are known
    worker: Worker
    inventory: Inventory
    binder: Binder
    ledger: Ledger  # what each GPU task and result holds, measured
    leaks: LeakCheck
    rejoin: WorkerActor | None  # devices left out at setup, asked again
    #: the inventory's visible devices once set up (kept up to date in place): with none,
    #: transitions are not routed
    _visible: Sequence[DeviceInfo] = ()

    def __init__(self, **options: Any) -> None:
        self.options = resolve_options(GUARD_OPTIONS, options, type(self).__name__)
        self.explicit = frozenset(options)  # given, not from config: a worker's own yields

    def __getstate__(self) -> dict[str, Any]:
        return {"options": self.options, "explicit": self.explicit}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.options = state["options"]
        self.explicit = state.get("explicit", frozenset())

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
            stored=functools.partial(internals.stored_value, worker),
            idle=lambda: {d.index for d in inv.owned} - self.binder.leases.busy(),
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
        )
        if o["unrequested_gpu"] != "ignore":
            self.binder.watch = Watch(
                monitor=inv.monitor,
                visible=inv.visible,
                fail=o["unrequested_gpu"] == "fail",
                emit=self._emit,
            )
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
        internals.stop_periodic(worker, _PERIODIC)
        if inv.visible or self.rejoin is not None:
            internals.start_periodic(worker, _PERIODIC, self.check, o["check_interval"])

    async def teardown(self, worker: Worker) -> None:
        """Unregistered: remove the report handler and stop the leak check."""
        internals.remove_handler(worker, REPORT_HANDLER, self.report)
        internals.stop_periodic(worker, _PERIODIC)
        if not hasattr(self, "leaks"):
            return  # set up no further than the check of distributed's internals
        internals.remove_handler(worker, DRAIN_HANDLER, self.inventory.drain)
        TABLES.discard(self.binder.leases)  # what it counted no longer runs under this guard
        internals.remove_metric(worker, GUARD_METRIC, self.leaks.heartbeat_metric)

    def transition(self, key: Any, start: str, finish: str, **kwargs: Any) -> None:
        """Track live results; route a task starting to execute (worker event loop).

        GPU tasks get a device lease; fallen-back tasks get their inputs on the host;
        other tasks are watched for GPU use. The wrapping itself is O(1); the work
        happens in the task's thread. Every transition of every task passes here.
        """
        if not self._visible:
            return
        worker, leaks, ledger, running = self.worker, self.leaks, self.ledger, self.binder.leases
        if finish in _RUNNING:  # a function starts running in a thread (every task counts)
            running.started(key)
            if start == "cancelled":  # wanted again while its thread ran on
                running.resume(key)
            if finish == "executing":
                prefix = key_split(key)
                leaks.ran(prefix)
                internals.wrap_execution(
                    worker,
                    key,
                    lambda k, res, ann: self.binder.route(
                        k,
                        res,
                        ann,
                        prefix,
                        granted=bool(self.inventory.granted),
                        draining=self.inventory.draining,
                    ),
                )
            return
        if finish == "memory":
            computed = start in _RUNNING  # here: its function has returned
            if ledger.entered(key, computed=computed):
                self._results_moved()
            if computed:
                self._ended(key)
                return
        elif (start == "memory" or finish == "forgotten") and ledger.released(key):
            self.binder.room_freed()
            self._results_moved()
        if key in running:  # started or ended, as its thread says (cancelled runs on)
            if start in _RUNNING and finish == "released":  # cancelled: its thread runs on
                self.binder.cancelled(key)
            elif start == "cancelled":  # wanted again, or its thread is done
                running.resume(key)
            if internals.runs_in_thread(worker, key):
                running.started(key)
            else:
                self._ended(key)

    def _ended(self, key: Any) -> None:
        """A task's function returned: if a check skipped its busy devices, judge them now,
        before the next task takes them (back-to-back GPU tasks hold them nearly always)."""
        if self.binder.leases.ended(key) and self.leaks.owed:
            self.leaks.check()

    def _results_moved(self) -> None:
        """Results took or gave back device memory: offered again once the room they
        leave moved by a step (so the scheduler places what fits, and sends back what no
        longer does), not at every result."""
        inv = self.inventory
        if inv.results_moved():
            inv.held_said = inv.held_in_steps()  # one offer per step moved, not per result
            internals.spawn(self.worker, inv.offer, self._use_devices)

    async def report(self) -> ReportReply:
        """Report the owned devices to the scheduler and advertise what it granted."""
        return await self.inventory.report(self._use_devices)

    def _use_devices(self, usable: list[int]) -> None:
        """Lease these devices, described as NVML verified them (for requirements)."""
        self.binder.set_devices(usable, self.inventory.granted, self.inventory.shares)

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


def preimport(modules: tuple[str, ...]) -> list[str]:
    """Import ``modules``; the names imported (skipped: not installed, or failing)."""
    done: list[str] = []
    for name in modules:
        start = time.perf_counter()
        try:
            importlib.import_module(name)
        except ImportError as exc:  # not installed here (or a dependency is not)
            logger.info("accelsched: preimport %s skipped: %s", name, exc)
            continue
        except Exception as exc:  # a module that fails to import costs its guard nothing
            logger.warning("accelsched: preimport %s failed: %r", name, exc)
            continue
        done.append(name)
        logger.debug("accelsched: preimported %s in %.2f s", name, time.perf_counter() - start)
    return done
