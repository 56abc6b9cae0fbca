"""GuardPlugin: the worker side of accelsched, wiring hooks to its parts.

The parts (``accelsched/worker/``):

- :class:`~accelsched.worker.inventory.Inventory`: probe the devices through NVML, report
  them to the PlacementPlugin, advertise what it granted; ask for this worker's restart.
- :class:`~accelsched.worker.binder.Binder`: give each running GPU task its own device,
  current in its thread; free pools after GPU tasks
  (:class:`~accelsched.worker.pool_freer.PoolFreer`).
- :class:`~accelsched.worker.watch.Watch`: notice a task that did not ask for a GPU but
  created a CUDA context or grew this process's device memory.
- :class:`~accelsched.worker.leak_check.LeakCheck`: every ``check_interval``, read the
  devices (:class:`~accelsched.worker.readings.DeviceReadings`) and estimate device memory
  nothing legitimate holds (:class:`~accelsched.worker.results.LiveResults` is what results
  hold); on a confirmed leak, ask for a lossless restart.
- :class:`~accelsched.worker.worker_actor.WorkerActor`: carries out what those decisions propose
  (events, withdrawals, reclaims, restart requests), the one place that acts on them.
- :class:`~accelsched.worker.rejoin.Rejoin`: ask NVML again, with backoff, about the
  devices left out of the inventory; report each back once it answers steadily.

The plugin itself checks at setup that the distributed internals the parts rely on are
there (:mod:`accelsched.internals`) and routes each task as it starts executing. What it
says to the scheduler is in :mod:`accelsched.protocol`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from dask.utils import key_split
from distributed.diagnostics.plugin import WorkerPlugin

from accelsched import events, internals, precedence
from accelsched.config import GUARD_OPTIONS, resolve_options
from accelsched.policy.health import DeviceHealth
from accelsched.policy.leak import Attribution, Verdict
from accelsched.protocol import (
    CONFIRM_HANDLER,
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
from accelsched.worker import results
from accelsched.worker.binder import Binder, Runner, send_back
from accelsched.worker.figures import Figures
from accelsched.worker.inventory import Inventory
from accelsched.worker.leak_check import LeakCheck, LeakOptions
from accelsched.worker.ledger import Ledger
from accelsched.worker.pool_freer import PoolFreer
from accelsched.worker.preimport import preimport
from accelsched.worker.readings import DeviceReadings
from accelsched.worker.rejoin import Rejoin
from accelsched.worker.results import LiveResults
from accelsched.worker.watch import Running, UnrequestedGPUUse, Watch
from accelsched.worker.worker_actor import WorkerActor

if TYPE_CHECKING:
    from distributed import Worker

__all__ = ["GuardPlugin", "UnrequestedGPUUse"]

logger = logging.getLogger(__name__)

_PERIODIC = "accelsched-guard"
_RUNNING = frozenset({"executing", "long-running"})


class GuardPlugin(WorkerPlugin):
    """Verified inventory, per-task device binding, unrequested-use watch, leak check.

    Options (each also dask config under ``accelsched.guard.``, see
    ``docs/configuration.md``) are validated here, on the client.
    """

    name = GUARD_PLUGIN

    def __init__(self, **options: Any) -> None:
        self.options = resolve_options(GUARD_OPTIONS, options, type(self).__name__)
        self.explicit = frozenset(options)  # given, not from config: a worker's own yields
        self._init_parts()

    def _init_parts(self) -> None:
        self.worker: Worker | None = None
        self.inventory = Inventory(advertise_undeclared=self.options["advertise_undeclared"])
        # built at setup, once the devices are known
        self.binder: Binder | None = None
        self.watch: Watch | None = None
        self.leaks: LeakCheck | None = None
        self.figures: Figures | None = None
        self.rejoin: Rejoin | None = None  # devices left out at setup, asked again
        # keys executing here, counted in ACTIVITY
        self.running = Running(self._in_thread, self._judge_owed)

    def __getstate__(self) -> dict[str, Any]:
        return {"options": self.options, "explicit": self.explicit}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.options = state["options"]
        self.explicit = state.get("explicit", frozenset())
        self._init_parts()

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
        o = self.options = precedence.guard_options_here(self.options, self.explicit, worker)
        preimport(o["preimport"])  # before this worker reads its first task
        inv = self.inventory = Inventory(advertise_undeclared=o["advertise_undeclared"])
        inv.probe(worker)
        assert inv.monitor is not None
        ledger = Ledger(inv.monitor)
        attribution = Attribution()
        self.binder = Binder(
            oom_exceptions=o["oom_exceptions"],
            pools=PoolFreer(
                every=o["free_pools_every"],
                above=o["free_pools_above"],
                minimum=o["free_pools_min"],
                monitor=inv.monitor,
            ),
            emit=self._emit,
            ledger=ledger,
            residue=attribution.record,  # what each run left behind, by step
            left_nothing=attribution.left_nothing,
        )
        if o["unrequested_gpu"] != "ignore":
            self.watch = Watch(
                monitor=inv.monitor,
                visible=inv.visible,
                fail=o["unrequested_gpu"] == "fail",
                emit=self._emit,
            )
        health = DeviceHealth()
        self.leaks = LeakCheck(
            readings=DeviceReadings(
                monitor=inv.monitor,
                owned=inv.owned,
                granted=lambda: inv.granted,
                health=health,
                recover=o["recover_gpus"],
            ),
            live=LiveResults(ledger=ledger, owned=inv.owned, leases=self.binder.leases),
            binder=self.binder,
            options=LeakOptions(o["leak_threshold"], o["leak_confirmations"], o["restart_on_leak"]),
            attribution=attribution,
            actor=WorkerActor(
                inventory=inv,
                set_devices=self._use_devices,
                emit=self._emit,
                spawn=lambda fn, *args: internals.spawn(worker, fn, *args),
            ),
            executing=lambda: internals.gpu_tasks_in_threads(worker),
        )
        if o["recover_gpus"] and inv.monitor.left_out:
            self.rejoin = Rejoin(
                inventory=inv,
                health=health,
                interval=o["check_interval"],
                report=self.report,
                spawn=lambda fn, *args: internals.spawn(worker, fn, *args),
                emit=self._emit,
            )
        self.figures = Figures(
            granted=lambda: inv.granted,
            withdrawn=lambda: inv.withdrawn,
            leases=self.binder.leases,
            leaks=self.leaks,
        )
        internals.add_metric(worker, GUARD_METRIC, self.figures.read)
        if inv.visible:  # as the transition hook, which alone uncounts them
            # registered again (a new GuardPlugin replaces the old one, whose teardown
            # stopped counting its tasks): what runs now still shares the process
            for key in internals.keys_in_threads(worker):
                self.running.started(key)
        internals.install_handler(worker, REPORT_HANDLER, self.report)
        internals.install_handler(worker, CONFIRM_HANDLER, inv.confirm)
        internals.install_handler(worker, DRAIN_HANDLER, inv.drain)
        if internals.serving(worker):
            await self.report()
        else:
            # Set up while the worker starts: it answers no RPC (the scheduler's
            # confirmation call included) until this returns, so report right after.
            internals.spawn(worker, self.report)
        internals.stop_periodic(worker, _PERIODIC)
        if inv.visible or self.rejoin is not None:
            internals.start_periodic(worker, _PERIODIC, self.check, o["check_interval"])

    async def teardown(self, worker: Worker) -> None:
        """Unregistered: remove the report handler and stop the leak check."""
        internals.remove_handler(worker, REPORT_HANDLER, self.report)
        internals.remove_handler(worker, CONFIRM_HANDLER, self.inventory.confirm)
        internals.remove_handler(worker, DRAIN_HANDLER, self.inventory.drain)
        internals.stop_periodic(worker, _PERIODIC)
        self.running.clear()
        if self.figures is not None:
            internals.remove_metric(worker, GUARD_METRIC, self.figures.read)

    def transition(self, key: Any, start: str, finish: str, **kwargs: Any) -> None:
        """Track live results; route a task starting to execute (worker event loop).

        GPU tasks get a device lease; fallen-back tasks get their inputs on the host;
        other tasks are watched for GPU use. The wrapping itself is O(1); the work
        happens in the task's thread. Every transition of every task passes here.
        """
        leaks = self.leaks
        if leaks is None or not self.inventory.visible:
            return
        live = leaks.live
        worker = self.worker
        assert worker is not None
        if finish in _RUNNING:  # a function starts running in a thread (every task counts)
            self.running.started(key)
            if finish == "executing":
                prefix = key_split(key)
                leaks.ran(prefix)
                internals.wrap_execution(
                    worker, key, lambda k, res, ann: self._runner(k, res, ann, prefix)
                )
            return
        if finish == "memory":
            computed = start in _RUNNING  # here: its function has returned
            results.stored(live, worker, key, computed=computed)
            if computed:
                self.running.ended(key)
                return
        elif start == "memory":
            live.released(key)
        if finish == "forgotten":
            live.ledger.drop(key)
        if key in self.running.keys:
            self.running.recount(key)

    def _in_thread(self, key: Any) -> bool:
        return self.worker is not None and internals.runs_in_thread(self.worker, key)

    def _judge_owed(self) -> None:
        """A task ended: if a check skipped its busy devices, judge them now, before the
        next task takes them (a queue of back-to-back GPU tasks holds them nearly always)."""
        if self.leaks is not None and self.leaks.owed:
            self.leaks.check()

    def _runner(
        self,
        key: Any,
        resources: Mapping[str, float],
        annotations: Mapping[str, Any],
        prefix: str,
    ) -> Runner | None:
        """The runner for a task starting to execute, or None to leave it alone."""
        assert self.binder is not None
        amount = resources.get(GPU, 0)
        if (amount > 0 or resources.get(GPU_MEMORY, 0) > 0) and self.inventory.granted:
            if self.inventory.draining:  # restarting: the scheduler places it elsewhere
                return send_back
            need = annotations.get(REQUIREMENT_ANNOTATION)
            return self.binder.gpu_runner(key, amount, prefix, need)
        watch = self.watch
        runner = watch.runner(key) if watch is not None and watch.sampled(prefix) else None
        if annotations.get(FALLBACK_ANNOTATION):
            return self.binder.fallback_runner(runner)
        return runner

    async def report(self) -> ReportReply:
        """Report the owned devices to the scheduler and advertise what it granted."""
        assert self.binder is not None
        return await self.inventory.report(self._use_devices)

    def _use_devices(self, usable: list[int]) -> None:
        """Lease these devices, described as NVML verified them (for requirements)."""
        assert self.binder is not None
        self.binder.set_devices(usable, self.inventory.granted)

    def check(self) -> list[Verdict]:
        """One leak check now (the periodic callback, every ``check_interval``). The
        next GPU task on each device reads NVML again: what the ledger knew of a device
        without a context (no reading to measure by) is forgotten at each check."""
        assert self.leaks is not None
        if self.rejoin is not None:
            self.rejoin.check()
        self.leaks.live.ledger.recheck()
        return self.leaks.check()

    def _emit(self, action: str, **figures: Any) -> None:
        """Send an event to the scheduler's log (from any thread)."""
        worker = self.worker
        assert worker is not None
        msg = events.event(action, worker.contact_address, **figures)
        logger.info("accelsched %s", msg)
        self.inventory.send_event(msg)
