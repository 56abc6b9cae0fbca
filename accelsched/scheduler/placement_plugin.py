"""PlacementPlugin: the scheduler side of accelsched, wiring hooks to its parts.

distributed treats ``resources={"GPU": n}`` as a label a worker declares. This plugin
makes the label mean something, through its parts (``accelsched/scheduler/``):

- :class:`~accelsched.scheduler.grants.Grants`: what each worker was granted (one owner
  per GPU UUID), declared, offers, and whether it is quarantined.
- :class:`~accelsched.scheduler.device_reports.DeviceReports`: the guards' inventory and
  offers; the GPU count placement uses, from the grant; re-offer of ``no-worker`` tasks;
  a worker's request is acted on once, and only from the process it names.
- :class:`~accelsched.scheduler.fallback.Fallback`: a GPU task unrunnable past its
  ``fallback_timeout`` runs its CPU form.
- :class:`~accelsched.scheduler.scheduler_actor.SchedulerActor`: carries out what the decisions
  propose (fallbacks, restarts without losing data, deferrals, quarantine: a worker's
  GPUs out of placement), in one place; drain orders reach the process meant.
- :class:`~accelsched.scheduler.snapshot.StatusHistory`: the status snapshot and its history.
- :class:`~accelsched.scheduler.demand.Demand`: what elastic pools (:func:`accelsched.adapt`)
  ask: the work waiting and running, and which classes a starting worker serves.

The plugin itself only wires distributed's hooks to those parts, checks at start that
the distributed internals they rely on are there (:mod:`accelsched.internals`), and
sends events. What the workers say to it is in :mod:`accelsched.protocol`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from distributed.diagnostics.plugin import SchedulerPlugin

from accelsched import display, events, internals
from accelsched.config import PLACEMENT_OPTIONS, resolve_options
from accelsched.policy.budget import RestartBudget
from accelsched.policy.proposals import Proposal
from accelsched.protocol import GPU, PLACEMENT_PLUGIN, RESTART_HANDLER
from accelsched.scheduler.demand import Demand
from accelsched.scheduler.device_reports import DeviceReports
from accelsched.scheduler.fallback import Fallback
from accelsched.scheduler.grants import Grants
from accelsched.scheduler.scheduler_actor import SchedulerActor
from accelsched.scheduler.snapshot import StatusHistory

if TYPE_CHECKING:
    from distributed import Scheduler

__all__ = ["PlacementPlugin", "GPU"]

logger = logging.getLogger(__name__)


class PlacementPlugin(SchedulerPlugin):
    """Verification gate, strict GPU placement, CPU fallback and restart coordination.

    Options (each also dask config under ``accelsched.placement.``, see
    ``docs/configuration.md``): ``fallback_timeout``, ``fallback_interval``,
    ``share_gpus``, ``max_restarts``, ``restart_window``, ``max_concurrent_restarts``.
    Invalid values raise ``ValueError``/``TypeError`` here, on the client.
    """

    name = PLACEMENT_PLUGIN

    scheduler: Scheduler | None = None  # until start
    _emitting: dict[str, Any] | None = None  # the event being logged by ``_emit``
    status_history: StatusHistory | None = (
        None  # until start: events logged before are replayed then
    )
    grants: Grants
    fallback: Fallback
    reports: DeviceReports
    actor: SchedulerActor
    demand: Demand

    def __init__(self, **options: Any) -> None:
        self.options = resolve_options(PLACEMENT_OPTIONS, options, type(self).__name__)

    def __getstate__(self) -> dict[str, Any]:
        # Only the options travel to the scheduler; the parts are built there, in start.
        return {"options": self.options}

    def _active(self) -> bool:
        """Whether this instance is the registered one (``unregister_scheduler_plugin``
        neither closes a plugin nor removes what its ``start`` installed)."""
        return self.scheduler is not None and self.scheduler.plugins.get(self.name) is self

    # --- SchedulerPlugin hooks ----------------------------------------------------------

    async def start(self, scheduler: Scheduler) -> None:
        """Check distributed's internals, then start the parts.

        Runs again when the plugin is re-registered: the previous instance's handlers and
        callbacks are replaced here, never stacked. Raises
        :class:`~accelsched.internals.IncompatibleDistributed`, which fails
        ``client.register_plugin``, when distributed changed what accelsched relies on.
        """
        internals.check_scheduler(scheduler)
        self.scheduler = scheduler
        o, emit, active = self.options, self._emit, self._active
        internals.notify_unregistered(scheduler)
        self.grants = grants = Grants(share_gpus=o["share_gpus"])
        self.fallback = Fallback(
            scheduler,
            timeout=o["fallback_timeout"],
            interval=o["fallback_interval"],
            grants=grants,
            emit=emit,
            active=active,
            act=self._act,
        )
        # every worker's declared GPUs stripped, then the guards asked to report
        self.reports = DeviceReports(
            scheduler,
            grants=grants,
            emit=emit,
            active=active,
            gained=self.fallback.follow,
        )
        self.reports.start()
        budget = RestartBudget(o["max_restarts"], o["restart_window"], o["max_concurrent_restarts"])
        self.actor = SchedulerActor(
            scheduler,
            fallback=self.fallback,
            grants=grants,
            reports=self.reports,
            budget=budget,
            emit=emit,
            active=active,
        )
        internals.install_handler(scheduler, RESTART_HANDLER, self.actor.handle_restart)
        self.demand = Demand(scheduler, fallback=self.fallback, grants=grants)
        self.demand.start()
        history = StatusHistory(
            scheduler,
            grants,
            waiting=self.fallback.waiting,
            options=self.options,
            pool_of=self.demand.pool_of,
        )
        history.start()
        self.status_history = history
        display.install(scheduler)

    def unregistered(self) -> None:
        """``client.unregister_scheduler_plugin``: leave the scheduler as it was found.

        Handlers (``set_resources`` too) go back to distributed's, the
        periodic check stops, and every worker's GPU count is its declaration again.
        """
        scheduler = self.scheduler
        if scheduler is None or self.status_history is None:
            return  # never started
        self.fallback.close()
        internals.remove_handler(scheduler, RESTART_HANDLER, self.actor.handle_restart)
        self.demand.stop()
        self.reports.stop()
        self.status_history.stop()

    async def close(self) -> None:
        """The scheduler closes: stop the periodic checks and the gauge's reading."""
        if self.status_history is None:
            return  # never started
        self.fallback.close()
        self.status_history.stop()
        self.reports.close()

    def add_worker(self, scheduler: Scheduler, worker: str) -> None:
        """Strip the declared GPU count: it counts only once the worker's guard reports.

        Runs before distributed offers ``no-worker`` tasks to the new worker, so nothing
        reaches it on the strength of a declaration.
        """
        self.reports.add_worker(scheduler.workers[worker])
        if self.status_history is not None:
            self.status_history.add_worker(scheduler.workers[worker])

    def remove_worker(self, scheduler: Scheduler, worker: str, **kwargs: Any) -> None:
        """Free the worker's GPUs for the next claimant and forget everything about it."""
        self.actor.remove_worker(worker)
        self.reports.remove_worker(worker)
        self.fallback.follow(worker)  # its classes lose it

    def update_graph(
        self, scheduler: Scheduler, *, tasks: list | None = None, **kwargs: Any
    ) -> None:
        """New tasks, still ``released``: make GPU restrictions hard, read timeouts."""
        self.fallback.prepare(tasks)

    def transition(self, key: Any, start: str, finish: str, *args: Any, **kwargs: Any) -> None:
        """Inside the transition loop: only bookkeeping and scheduling a check."""
        self.fallback.transition(key, start, finish, str(kwargs.get("stimulus_id", "")))

    def log_event(self, topic: str, msg: Any) -> None:
        """Every event the scheduler logs: feed accelsched's own to the metrics.

        Worker-side events (``leak``, ``unrequested-gpu-use``, ...) arrive here too.
        """
        if topic == events.TOPIC and isinstance(msg, dict):
            display.count_event(msg)
            if self.status_history is not None:
                self.status_history.record_event(msg)
            # the workers' events (a leak, a device withdrawn, ...) in the scheduler's log
            # too, once: this plugin's own were logged as they were emitted
            action, mine = msg.get("action"), msg is self._emitting
            if not mine and isinstance(action, str) and action in events.ACTIONS and self._active():
                logger.log(*events.log_line(msg))

    # --- for the parts ------------------------------------------------------------------

    def _act(self, proposals: Iterable[Proposal], *, keep_devices: bool = False) -> None:
        """The parts hand what the decisions propose to the one place that acts."""
        self.actor.act(proposals, keep_devices=keep_devices)

    def _emit(self, action: str, worker: str | None = None, **figures: Any) -> None:
        assert self.scheduler is not None  # parts exist only once started
        msg = events.event(action, worker, **figures)
        logger.log(*events.log_line(msg))  # here: the hook below runs only once registered
        self._emitting = msg
        try:
            self.scheduler.log_event(events.TOPIC, msg)
        finally:
            self._emitting = None
