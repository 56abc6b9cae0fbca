"""PlacementPlugin: the scheduler side of accelsched, wiring hooks to its parts.

distributed treats ``resources={"GPU": n}`` as a label a worker declares. This plugin
makes the label mean something, through its parts (``accelsched/scheduler/``):

- :class:`~accelsched.scheduler.authority.Authority`: only a worker speaks for itself;
  only the scheduler gives orders.
- :class:`~accelsched.scheduler.grants.Grants`: what each worker was granted (one owner
  per GPU UUID), declared, offers, and whether it is quarantined.
- :class:`~accelsched.scheduler.gpu_counts.GpuCounts`: the GPU count placement uses,
  from the grant; re-offer of ``no-worker`` tasks.
- :class:`~accelsched.scheduler.device_reports.DeviceReports`: the guards' inventory and
  offers.
- :class:`~accelsched.scheduler.fallback.Fallback`: a GPU task unrunnable past its
  ``fallback_timeout`` runs its CPU form.
- :class:`~accelsched.scheduler.restarts.Restarts`: a leaking worker is restarted
  without losing data, or quarantined.
- :class:`~accelsched.scheduler.scheduler_actor.SchedulerActor`: carries out what the decisions
  propose (fallbacks, restarts, deferrals, quarantine: a worker's GPUs out of
  placement), in one place.
- :class:`~accelsched.scheduler.snapshot.Observer`: the status snapshot and its history.

The plugin itself only wires distributed's hooks to those parts, checks at start that
the distributed internals they rely on are there (:mod:`accelsched.internals`), and
sends events. What the workers say to it is in :mod:`accelsched.protocol`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from distributed.diagnostics.plugin import SchedulerPlugin

from accelsched import events, internals
from accelsched.config import PLACEMENT_OPTIONS, resolve_options
from accelsched.observe import dashboard_page, metrics
from accelsched.policy.budget import RestartBudget
from accelsched.policy.proposals import Proposal
from accelsched.protocol import EVENT_OP, GPU, PLACEMENT_PLUGIN, RESTART_HANDLER
from accelsched.scheduler.authority import Authority
from accelsched.scheduler.device_reports import DeviceReports
from accelsched.scheduler.eligibility import Eligibility
from accelsched.scheduler.fallback import Fallback
from accelsched.scheduler.gpu_counts import GpuCounts
from accelsched.scheduler.grants import Grants
from accelsched.scheduler.restarts import Restarts
from accelsched.scheduler.scheduler_actor import SchedulerActor
from accelsched.scheduler.snapshot import Observer
from accelsched.scheduler.unplaced import WaitingTasks

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

    def __init__(self, **options: Any) -> None:
        self.options = resolve_options(PLACEMENT_OPTIONS, options, type(self).__name__)
        self._init_parts()

    def _init_parts(self) -> None:
        o = self.options
        emit, active = self._emit, self._active
        self.scheduler: Scheduler | None = None
        self.authority = Authority(emit=emit)
        self.grants = Grants(share_gpus=o["share_gpus"])
        self.eligibility = Eligibility(self.grants, emit=emit)
        self.counts = GpuCounts(self.grants, active=active, eligibility=self.eligibility)
        self.reports = DeviceReports(
            grants=self.grants,
            counts=self.counts,
            authority=self.authority,
            emit=emit,
            active=active,
        )
        self.fallback = Fallback(
            timeout=o["fallback_timeout"],
            interval=o["fallback_interval"],
            emit=emit,
            active=active,
            act=self._act,
            eligibility=self.eligibility,
        )
        budget = RestartBudget(o["max_restarts"], o["restart_window"], o["max_concurrent_restarts"])
        self.restarts = Restarts(
            budget=budget,
            authority=self.authority,
            emit=emit,
            active=active,
            act=self._act,
        )
        self.actor = SchedulerActor(
            fallback=self.fallback,
            restarts=self.restarts,
            grants=self.grants,
            counts=self.counts,
            authority=self.authority,
            emit=emit,
        )
        self.waiting = WaitingTasks(emit=emit, active=active)
        self.observer = Observer(self.grants, waiting=self.waiting.counts, options=o)

    def __getstate__(self) -> dict[str, Any]:
        # Only the options travel to the scheduler; the parts are built there.
        return {"options": self.options}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.options = state["options"]
        self._init_parts()

    def _active(self) -> bool:
        """Whether this instance is the registered one (``unregister_scheduler_plugin``
        neither closes a plugin nor removes what its ``start`` installed)."""
        return self.scheduler is not None and internals.is_registered(
            self.scheduler, self.name, self
        )

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
        internals.install_handler(scheduler, RESTART_HANDLER, self.restarts.handle_restart)
        internals.notify_unregistered(scheduler)
        # the event log is the source of the counts, the metrics and the history: only
        # the scheduler writes accelsched's events (a guard's arrive on its worker's stream)
        internals.reserve_topic(scheduler, events.TOPIC, EVENT_OP, self._worker_event)
        self.restarts.start(scheduler)
        self.eligibility.start(scheduler)
        self.fallback.start(scheduler)
        self.waiting.start(scheduler)
        self.authority.start(scheduler)
        self.actor.start(scheduler)
        self.counts.start(scheduler)  # every worker's declared GPUs stripped
        self.reports.start(scheduler)  # then the guards asked to report
        self.observer.start(scheduler)
        dashboard_page.install(scheduler)

    def unregistered(self) -> None:
        """``client.unregister_scheduler_plugin``: leave the scheduler as it was found.

        Handlers (``set_resources`` and ``log_event`` too) go back to distributed's, the
        periodic check stops, and every worker's GPU count is its declaration again.
        """
        scheduler = self.scheduler
        if scheduler is None:
            return
        self.fallback.close()
        self.waiting.close()
        internals.remove_handler(scheduler, RESTART_HANDLER, self.restarts.handle_restart)
        internals.release_topic(scheduler, events.TOPIC, EVENT_OP)
        self.reports.stop()
        self.authority.stop()
        self.counts.stop()
        self.observer.stop()

    async def close(self) -> None:
        """The scheduler closes: stop the periodic checks and the gauge's reading."""
        self.fallback.close()
        self.waiting.close()
        self.observer.stop()
        self.counts.close()

    def add_worker(self, scheduler: Scheduler, worker: str) -> None:
        """Strip the declared GPU count: it counts only once the worker's guard reports.

        Runs before distributed offers ``no-worker`` tasks to the new worker, so nothing
        reaches it on the strength of a declaration.
        """
        self.counts.add_worker(scheduler.workers[worker])
        self.observer.add_worker(scheduler.workers[worker])

    def remove_worker(self, scheduler: Scheduler, worker: str, **kwargs: Any) -> None:
        """Free the worker's GPUs for the next claimant and forget everything about it."""
        self.actor.remove_worker(worker)
        self.reports.remove_worker(worker)
        self.authority.forget(worker)

    def update_graph(
        self, scheduler: Scheduler, *, tasks: list | None = None, **kwargs: Any
    ) -> None:
        """New tasks, still ``released``: make GPU restrictions hard, read timeouts."""
        self.fallback.prepare(scheduler, tasks)

    def transition(self, key: Any, start: str, finish: str, *args: Any, **kwargs: Any) -> None:
        """Inside the transition loop: only bookkeeping and scheduling a check."""
        self.fallback.transition(key, start, finish)
        if key in self.eligibility.keys:  # a task with a requirement
            self.eligibility.moved(key, start, finish, str(kwargs.get("stimulus_id", "")))

    def log_event(self, topic: str, msg: Any) -> None:
        """Every event the scheduler logs: feed accelsched's own to the metrics.

        Worker-side events (``leak``, ``unrequested-gpu-use``, ...) arrive here too.
        """
        if topic == events.TOPIC and isinstance(msg, dict):
            metrics.observe(msg)
            self.observer.observe(msg)

    def _worker_event(self, worker: Any = "", msg: Any = None, token: Any = None) -> None:
        """A guard's event (``EventMessage``): logged in the name of the worker whose
        token it carries. ``worker`` is distributed's stamp, which a message naming
        another worker overrides; the token is what only that worker's process holds."""
        owner = self.authority.speaks_for(worker, token)
        if owner is None or self.scheduler is None:
            logger.warning("accelsched: dropped an event that %s cannot vouch for", worker)
            return
        if isinstance(msg, dict) and msg.get("action") in events.ACTIONS:
            self.scheduler.log_event(events.TOPIC, {**msg, "worker": owner})

    # --- for the parts ------------------------------------------------------------------

    def _act(self, proposals: Iterable[Proposal], *, keep_devices: bool = False) -> None:
        """The parts hand what the decisions propose to the one place that acts."""
        self.actor.act(proposals, keep_devices=keep_devices)

    def _emit(self, action: str, worker: str | None = None, **figures: Any) -> None:
        assert self.scheduler is not None
        msg = events.event(action, worker, **figures)
        logger.info("accelsched %s", msg)
        self.scheduler.log_event(events.TOPIC, msg)
