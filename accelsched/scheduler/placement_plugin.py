"""PlacementPlugin: the scheduler side of accelsched, wiring hooks to its parts.

distributed treats ``resources={"GPU": n}`` as a label a worker declares. This plugin
makes the label mean something, through its parts (``accelsched/scheduler/``):

- :class:`~accelsched.scheduler.grants.Grants`: what each worker was granted (one owner
  per GPU UUID), declared, offers, and whether it is quarantined.
- :class:`~accelsched.scheduler.grants.DeviceReports`: the guards' inventory and
  offers; the GPU count placement uses, from the grant; re-offer of ``no-worker`` tasks;
  a worker's request is acted on once, and only from the process it names.
- :class:`~accelsched.scheduler.fallback.Fallback`: a GPU task unrunnable past its
  ``fallback_timeout`` runs its CPU form.
- the plugin itself (:meth:`PlacementPlugin.act`): carries out what the decisions
  propose (fallbacks, restarts without losing data, deferrals, quarantine: a worker's
  GPUs out of placement), in one place; drain orders reach the process meant.
- :class:`~accelsched.scheduler.grants.StatusHistory`: the status snapshot and its history.
- :class:`~accelsched.scheduler.fallback.Fallback` also answers what elastic pools
  (:func:`accelsched.adapt`) ask: the work waiting and running, and which classes a
  starting worker serves.

Beside acting, the plugin only wires distributed's hooks to those parts, checks at start
that the distributed internals they rely on are there (:mod:`accelsched.internals`), and
sends events. What the workers say to it is in :mod:`accelsched.protocol`.

The one place the scheduler acts on a decision, restarts included, is
:meth:`PlacementPlugin.act`. distributed's Active Memory Manager has its policies suggest
and acts in one place; accelsched does the same. The decisions
(:mod:`accelsched.policy`) answer with :class:`~accelsched.policy.proposals.Proposal`
objects and change nothing; the parts that ask them (the fallback check, the restart
handler and procedure) hand the proposals here, and :meth:`PlacementPlugin.act` carries
each out:

========== ============================================================================
fall-back  :meth:`Fallback.fall_back <accelsched.scheduler.fallback.Fallback.fall_back>`:
           the task's GPU restriction lifted, marked, sent on; one ``fallback`` event
           per check (one per task up to a few)
err        the task errs, naming why it can never be placed
restart    :meth:`PlacementPlugin.restart_worker`: drain, retire, check, restart, in
           the background
defer      ``restart-deferred`` (when its reason is news), and quarantine
quarantine :meth:`PlacementPlugin.quarantine`, reason ``restart-<reason>``
           (``restart-budget``)
========== ============================================================================

A restart: a worker's guard asks (``accelsched_restart``, admitted once and only from
the process it names: :meth:`DeviceReports.admits
<accelsched.scheduler.grants.DeviceReports.admits>`);
:func:`accelsched.policy.requests.admit_restart` proposes what to do and
:func:`accelsched.policy.requests.restart_reply` is the answer. An admitted restart drains
the worker (its guard sends queued GPU tasks back to the scheduler, its executing tasks
finish), retires it (its keys move to peers), checks that worked, then restarts it
through its nanny (:func:`accelsched.internals.replace_worker`). When that cannot happen
without loss, the restart is deferred.

Quarantine: a worker whose restart cannot happen now, or that restarted too often lately,
keeps leaking. Its GPUs leave placement (its GPU count is 0) until it leaves, and the GPU
tasks already sent to it go elsewhere or fall back: its guard sends them back as they
reach execution, once told to drain (:meth:`PlacementPlugin.tell_draining`; the order
names the process it is meant for: a new process that took the address since ignores
it). A restarted worker registers anew, unquarantined.

A worker that asked for its restart because a device failed keeps the devices that
answer (``keep_devices``, :func:`accelsched.policy.requests.keeps_devices`): its deferral is
said but quarantines nothing, and over its budget nothing happens.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from functools import partial
from time import monotonic, time
from typing import TYPE_CHECKING, Any

from distributed.diagnostics.plugin import SchedulerPlugin

from accelsched import display, events, internals
from accelsched.config import PLACEMENT_OPTIONS, resolve_options
from accelsched.events import shown
from accelsched.policy.proposals import Proposal
from accelsched.policy.requests import RestartBudget, admit_restart, keeps_devices, restart_reply
from accelsched.protocol import (
    DRAIN_HANDLER,
    GPU,
    GPU_MEMORY,
    PLACEMENT_METADATA,
    PLACEMENT_PLUGIN,
    RESTART_HANDLER,
    RestartReply,
)
from accelsched.scheduler.fallback import Fallback
from accelsched.scheduler.grants import DeviceReports, Grants, StatusHistory

if TYPE_CHECKING:
    from distributed import Scheduler
    from distributed.scheduler import WorkerState

__all__ = ["PlacementPlugin", "DRAIN_TIMEOUT", "GPU"]

logger = logging.getLogger(__name__)


#: How long a restart waits for the worker's executing tasks before giving up.
DRAIN_TIMEOUT = 300.0
#: How long a restart waits for the old process to leave the scheduler.
GONE_TIMEOUT = 30.0


class PlacementPlugin(SchedulerPlugin):
    """Verification gate, strict GPU placement, CPU fallback and restart coordination.

    Options (each also dask config under ``accelsched.placement.``, see
    ``docs/configuration.md``): ``fallback_timeout``, ``fallback_interval``,
    ``share_gpus``, ``max_restarts``, ``restart_window``, ``max_concurrent_restarts``.
    Invalid values raise ``ValueError``/``TypeError`` here, on the client.
    """

    name = PLACEMENT_PLUGIN

    # until start (an unpickled plugin has none); every method that reads it runs after
    scheduler: Scheduler = None  # type: ignore[assignment]
    _emitting: dict[str, Any] | None = None  # the event being logged by ``_emit``
    status_history: StatusHistory | None = None  # until start: events before replayed then

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
        display.gpus_from(grants.gauge)
        self.fallback = Fallback(
            scheduler,
            timeout=o["fallback_timeout"],
            interval=o["fallback_interval"],
            grants=grants,
            emit=emit,
            active=active,
            act=self.act,
            restarting=lambda ws: (ws.nanny or ws.address) in self.budget.in_flight,
        )
        # every worker's declared GPUs stripped, then the guards asked to report
        self.reports = DeviceReports(
            scheduler,
            grants=grants,
            emit=emit,
            active=active,
            gained=self.fallback.follow,
        )
        self.budget = RestartBudget(
            o["max_restarts"], o["restart_window"], o["max_concurrent_restarts"]
        )
        self.deferred: dict[str, str] = {}  # worker -> reason of its last deferral
        self._retire_lock = asyncio.Lock()  # see internals.replace_worker
        internals.install_handler(scheduler, RESTART_HANDLER, self.handle_restart)
        self.status_history = StatusHistory(
            scheduler,
            grants,
            waiting=self.fallback.waiting,
            options=self.options,
            pool_of=self.fallback.pool_of,
        )
        display.install(scheduler)
        previous = internals.last_started(scheduler, self.name, self)  # (now started)
        if previous is not None and previous is not self and previous.status_history is not None:
            self._carry(previous)
        # said last, once every handler serves (the reports asked above run after this)
        scheduler.set_metadata([PLACEMENT_METADATA], True)

    def _carry(self, previous: PlacementPlugin) -> None:
        """What the instance this one replaces (re-registered, say to change an option)
        decided that lasts: its quarantines, while the same worker process runs (a worker
        is quarantined until it restarts or leaves), and the restarts it took, which count
        against this one's budget. Without them a leaking worker would take GPU tasks
        again until its new guard found the leak once more."""
        for worker, reason, process in previous.grants.quarantines():
            ws = self.scheduler.workers.get(worker)
            if ws is not None and ws.server_id == process:
                # (its guard, registered again or not, is told to drain as it reports)
                self.grants.quarantine(worker, reason, process)
        self.budget = previous.budget.held_to(self.budget)

    def restart(self, scheduler: Scheduler) -> None:
        """``client.restart()``: it cleared the scheduler's metadata with its tasks, so
        the PlacementPlugin says again that it serves, before the new workers report."""
        scheduler.set_metadata([PLACEMENT_METADATA], True)

    def unregistered(self) -> None:
        """``client.unregister_scheduler_plugin``, once the plugin is closed (see
        :func:`~accelsched.internals.notify_unregistered`): leave the scheduler as it was
        found. Handlers (``set_resources`` too) go back to distributed's, and every
        worker's GPU count is its declaration again.
        """
        if self.status_history is None:
            return  # never started
        internals.remove_handler(self.scheduler, RESTART_HANDLER, self.handle_restart)
        self.reports.stop()
        served = self.name in self.scheduler.plugins  # one registered since serves on
        self.scheduler.set_metadata([PLACEMENT_METADATA], served)
        if not served:  # the guards learn now that nobody listens: they send no more
            self.reports.ask_guards()

    async def close(self) -> None:
        """The scheduler closes: stop the periodic checks and the gauge's reading."""
        if self.status_history is None:
            return  # never started
        self.fallback.close()
        self.status_history.stop()
        display.stop_gpus(self.grants.gauge)

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
        self.deferred.pop(worker, None)
        self.reports.remove_worker(worker)
        self.fallback.follow(worker)  # its classes lose it

    def update_graph(
        self, scheduler: Scheduler, *, tasks: list | None = None, **kwargs: Any
    ) -> None:
        """New tasks, still ``released``: make GPU restrictions hard, read timeouts."""
        self.fallback.prepare(tasks)

    def transition(self, key: Any, start: str, finish: str, *args: Any, **kwargs: Any) -> None:
        """Inside the transition loop: only bookkeeping and scheduling a check."""
        if finish == "forgotten" and isinstance(key, str) and key == PLACEMENT_METADATA:
            # distributed dropped a task's metadata under its key, and this key is ours
            self.scheduler.set_metadata([PLACEMENT_METADATA], True)
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

    # --- the one place that acts on what the decisions propose ------------------------

    def act(self, proposals: Iterable[Proposal], *, keep_devices: bool = False) -> None:
        """Carry out ``proposals``, in order; fallbacks together, after the rest, so one
        check's tasks are sent on (and told of) at once.

        ``err``: the task errs, naming why it cannot be placed. ``restart``: admitted just
        now, with no wait since, it runs in the background (:meth:`restart_worker`), its
        budget spent until it ends. ``defer``: the restart cannot happen without loss
        now: said once per reason, and the worker quarantined (one gone meanwhile:
        nothing)."""
        fall_back: list[Proposal] = []
        for p in proposals:
            worker = str(p.subject)
            if p.action == "fall-back":
                fall_back.append(p)
            elif p.action == "err":
                if not self.fallback.still_unrunnable(p.subject):
                    continue  # an action before it in this batch released it: nobody waits
                internals.fail_task(
                    self.scheduler,
                    p.subject,
                    ValueError(f"task {p.subject!r}: {p.reason}"),
                    f"accelsched-fallback-{time()}",
                )
            elif p.action == "restart":
                ws = self.scheduler.workers[worker]
                assert ws.nanny is not None
                internals.spawn(
                    self.scheduler, self.restart_worker, ws, ws.nanny, p.reason or "leak"
                )
            elif p.action == "defer":
                if worker not in self.scheduler.workers:
                    continue  # it left meanwhile: nothing to defer
                if self.deferred.get(worker) != (reason := p.reason or ""):
                    self.deferred[worker] = reason
                    self._emit(events.RESTART_DEFERRED, worker, reason=reason)
                if not keep_devices:
                    self.quarantine(worker, f"restart-deferred: {reason}")
            elif p.action == "quarantine":
                if not keep_devices:
                    self.quarantine(worker, f"restart-{p.reason}")
            else:
                raise ValueError(f"not a scheduler action: {p!r}")
        if fall_back:
            self.fallback.fall_back(fall_back)

    def quarantine(self, worker: str, reason: str) -> None:
        """Take ``worker``'s GPUs out of placement, once, and say so (a worker gone, or
        quarantined already: nothing). No GPU task is placed on it any more; what it was
        sent already is its guard's to send back, as it reaches execution."""
        ws = self.scheduler.workers.get(worker)
        if ws is None or not self.grants.quarantine(worker, reason, ws.server_id):
            return
        for name in (GPU, GPU_MEMORY):
            if name in ws.resources:
                internals.set_worker_gpus(self.scheduler, ws, 0, name)
        # GPU tasks already sent to it go elsewhere too
        internals.spawn(self.scheduler, self.tell_draining, worker, True)
        self._emit(events.QUARANTINE, worker, reason=reason)

    async def tell_draining(self, worker: str, on: bool) -> None:
        """Order the worker's guard to send GPU tasks back as they reach execution (or to
        run them again).

        distributed sends every GPU task to a valid worker at once; a worker restarting
        or quarantined would otherwise work through its queue. Only the worker knows which
        tasks it runs, so it turns the rest away itself (distributed's ``Reschedule``):
        nothing that finished is released, nothing runs twice. The order names the
        process it is meant for; a worker without a guard works through its queue.
        """
        ws = self.scheduler.workers.get(worker)
        if ws is None:
            return  # gone: nothing to drain
        try:
            await getattr(self.scheduler.rpc(worker), DRAIN_HANDLER)(on=on, process=ws.server_id)
        except Exception as exc:  # gone, or no guard
            logger.debug("accelsched: %s was not told to drain (%s): %r", worker, on, exc)

    # --- restarts ------------------------------------------------------------------------

    async def handle_restart(
        self,
        comm: Any,
        worker: str,
        process: str = "",
        request: str = "",
        reason: str = "leak",
        **figures: Any,
    ) -> RestartReply:
        """A worker asks to be restarted, from the process registered at that address,
        once per request id: a late request from a process since replaced does not
        restart the new one. The restart runs in the background; the reply says whether
        it was accepted."""
        if not self._active():
            return {"status": "no-plugin"}
        ws = self.scheduler.workers.get(worker)
        if ws is None or not self.reports.admits(worker, process, request, RESTART_HANDLER):
            return restart_reply(None, authentic=False)
        proposal = admit_restart(
            self.budget,
            ws.nanny or worker,
            monotonic(),
            worker=worker,
            why=reason,
            has_nanny=ws.nanny is not None,
            # a lone worker holding and running nothing has nothing to move: restarted
            # (its GPUs would otherwise stay quarantined for as long as it is alone)
            has_peer=internals.has_running_peer(self.scheduler, ws) or internals.idle_and_empty(ws),
        )
        if proposal is not None:
            self.act([proposal], keep_devices=keeps_devices(reason))
        return restart_reply(proposal)

    async def restart_worker(self, ws: WorkerState, budget_key: str, why: str) -> None:
        """Drain, retire, check, restart: the only order that loses nothing. Given up,
        the restart is deferred first (a leaking worker is quarantined), then the worker
        taken back into service: in this order the GPU tasks that piled up during the
        drain are not offered to the worker that leaks, they wait for (or fall back
        from) other GPUs."""
        start, previous = monotonic(), ws.status
        # the reason in distributed's own lines too ("Retire worker ... stimulus_id=...")
        # (a worker's own word: a plain token only)
        tag = why if why.replace("-", "").isalnum() else "other"
        stimulus_id = f"accelsched-restart-{tag}-{time()}"
        logger.info(
            "accelsched: restarting %s (%s): drained, retired to its peers, then restarted "
            "through its nanny (stimulus_id %s)",
            ws.address,
            shown(why),
            stimulus_id,
        )
        outcome: dict[str, int] | str | None = None
        try:
            outcome = await internals.replace_worker(
                self.scheduler,
                ws,
                stimulus_id,
                tell_draining=partial(self.tell_draining, ws.address),
                lock=self._retire_lock,
                drain_timeout=DRAIN_TIMEOUT,
                gone_timeout=GONE_TIMEOUT,
            )
        except Exception as exc:
            logger.exception("accelsched: restart of %s failed", ws.address)
            outcome = f"restart-failed: {exc!r}"
        finally:
            self.budget.done(budget_key, counted=isinstance(outcome, dict))
        if isinstance(outcome, dict):
            seconds = round(monotonic() - start, 3)  # request to restart
            self._emit(events.RESTART, ws.address, reason=why, **outcome, seconds=seconds)
        elif outcome is not None:
            keep = keeps_devices(why)
            self.act([Proposal("defer", ws.address, outcome)], keep_devices=keep)
            internals.resume(self.scheduler, ws, previous, stimulus_id)
            if keep:  # back in service with its devices that answer: run GPU tasks
                internals.spawn(self.scheduler, self.tell_draining, ws.address, False)

    def _emit(self, action: str, worker: str | None = None, **figures: Any) -> None:
        msg = events.event(action, worker, **figures)
        logger.log(*events.log_line(msg))  # here: the hook below runs only once registered
        self._emitting = msg
        try:
            self.scheduler.log_event(events.TOPIC, msg)
        finally:
            self._emitting = None
