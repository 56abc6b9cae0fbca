"""GPU tasks on the scheduler: one record each, CPU fallback, and what they wait for.

New GPU tasks are prepared in ``update_graph`` (their restriction made hard, their
timeout read: :func:`~accelsched.policy.timeouts.task_timeout`,
their requirement: see below). Each gets one
:class:`GpuTask` record, kept in one dict and forgotten in one place (the task is
forgotten). A GPU task with a timeout that becomes unrunnable enters
:class:`~accelsched.policy.timeouts.Deadlines` at its
:func:`~accelsched.policy.timeouts.deadline`; a check pops only the tasks that are due and
asks :func:`~accelsched.policy.timeouts.sweep` which fall back now. Its proposals (and an
``err`` for each task with an invalid annotation) go to the PlacementPlugin, the one that acts
(:mod:`accelsched.scheduler.placement_plugin`), which has :meth:`Fallback.fall_back` lift
their GPU restriction (marking them, so the worker copies their device inputs to the
host) and send them on, or err them. A check costs what is due, not
what waits: nothing when no task has a timeout, O(k log n) for k due of n waiting. Checks
run exactly at the next deadline (one timer at a time, at most one check queued for a
deadline already passed), with a periodic tick as a safety net.

Plain distributed leaves a task no worker can take in ``no-worker`` without a word. A
one-second tick counts the GPU tasks unplaced for
:data:`~accelsched.policy.timeouts.NOTICE_AFTER` by reason
(:mod:`accelsched.policy.timeouts` decides) and says each new reason once
(``gpu-waiting``); ``accelsched status`` shows the counts.

A task whose step or annotation says what its device must be (memory, model, compute
capability, MIG; :mod:`accelsched.policy.requirements`) is restricted to the workers
whose granted devices, as NVML verified them, can hold it: as many devices as it takes
that meet it, and for a task that declares memory one whose declarable capacity (less the
reserve) is that large. A ``workers=`` restriction of its own stays: the two meet. A
task that declares memory takes ``GPU-memory`` (MiB) instead of a whole ``GPU``, so tasks
share a device while their needs fit; the worker's lease table packs them per device.
The requirement travels to the worker normalised in the task's ``gpu`` annotation; an
annotated requirement and those of the marked steps the task calls combine.

Tasks with the same requirement, device count and own restriction form one
:class:`Eligible` class, and every task of a class holds the class's one set of workers
as its ``worker_restrictions`` (distributed only ever replaces that set, never edits
it). So a worker whose devices are granted joins the class, and one that leaves goes,
for every task of the class at once, whatever its state: nothing is stranded on a
departed worker, a late-verified worker gets its share, and a task costs one dict lookup
and no copy, whatever the cluster's size. The set always holds a placeholder address no
worker has, so it is never empty (an empty restriction would mean "anywhere").

A requirement no verified device in the cluster meets is said once
(``unmet-requirement``) and its tasks wait, or run their CPU form after their timeout,
as any unplaced GPU task. A worker that sends such a task back (its device withdrawn:
which one, the offer does not say) leaves the task's class until its devices are
granted or offered again, so nothing bounces.

What elastic pools ask (:meth:`Fallback.demand`, :meth:`Fallback.pools`):
:func:`accelsched.adapt` asks ``accelsched_demand`` every interval for the GPU tasks by
class (requirement and device count, as :meth:`Fallback.class_of` names them), the other
tasks ready or running, and each worker (busy or not, its verified devices); it answers
``accelsched_pools`` with the classes a starting worker will serve, which the fallback
timers go by (:meth:`Fallback.pools`), and with its pools' names, by which ``accelsched
status`` shows each worker's pool. One pass over the tasks ready or running per call:
nothing is kept per task there.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from dataclasses import dataclass, replace
from time import monotonic, time
from typing import TYPE_CHECKING, Any
from weakref import WeakValueDictionary

import dask.config
from dask.utils import parse_timedelta
from distributed.comm.addressing import get_address_host
from distributed.core import Status

from accelsched import events, internals
from accelsched.policy.marks import Mark, find_mark, mark_problem
from accelsched.policy.proposals import Proposal
from accelsched.policy.requirements import (
    DeviceFacts,
    Requirement,
    capacity,
    combine,
    device_count_problem,
    devices_needed,
    invalid_amount,
    mebibytes,
    parse_requirement,
)
from accelsched.policy.scaling import counted_from
from accelsched.policy.timeouts import (
    MAX_GPUS,
    NOTICE_AFTER,
    Deadlines,
    Notices,
    Waiting,
    deadline,
    reason_for,
    summarise,
    sweep,
    task_timeout,
)
from accelsched.protocol import (
    DEMAND_HANDLER,
    FALLBACK_ANNOTATION,
    GPU,
    GPU_MEMORY,
    INVALID_RESOURCE,
    POOLS_HANDLER,
    REQUIREMENT_ANNOTATION,
    ClassDemand,
    DemandReply,
)
from accelsched.scheduler.grants import Grants, facts_of

if TYPE_CHECKING:
    from distributed import Scheduler
    from distributed.scheduler import WorkerState


__all__ = ["Eligible", "Fallback", "GpuTask"]

logger = logging.getLogger(__name__)

_PERIODIC = "accelsched-fallback"
_WAITING = "accelsched-waiting"
#: Seconds between looks at what waits: a waiting reason is said within NOTICE_AFTER and this.
TICK = 1.0
#: Keys named in a ``gpu-waiting`` event, as examples.
EXAMPLES = 3

#: A check that falls back more tasks than this logs one summary event, not one each.
FALLBACK_DETAIL = 10

#: Task states past placement: their restrictions no longer count.
DONE = frozenset({"memory", "erred", "forgotten"})
#: Seconds a worker that sent a requirement task back stays out of the task's class, so
#: the task does not bounce between it and the scheduler; then it is judged again.
BENCH = 5.0
#: A worker address no worker has: the restriction of a task no worker can serve yet.
NOWHERE = "accelsched://no-verified-device-meets-the-requirement"
#: How distributed names the stimulus of a task its worker sent back (``Reschedule``).
_SENT_BACK = "reschedule"


#: Seconds what elastic pools last said of pools at their maximum holds (they say it
#: every interval while they run; stopped, they say nothing more).
FULL_SAID_FOR = 60.0
#: The classes whose last promise of a starting worker is kept (the pools have a few).
_CLASSES_KEPT = 1024
#: What makes tasks one class: requirement, devices it takes, own ``workers=``.
ClassKey = tuple[Requirement, int, frozenset[str] | None]


@dataclass(eq=False)
class Eligible:
    """The workers one class of requirement tasks may run on, shared by its tasks (their
    records hold it; the fallback's table of classes only weakly: the class goes with the
    last task that holds it)."""

    key: ClassKey
    workers: set[str]  # every task's ``worker_restrictions``; NOWHERE always in it


@dataclass(slots=True, eq=False)
class GpuTask:
    """One GPU task as the scheduler holds it, from ``update_graph`` until forgotten."""

    timeout: float | None  # seconds unplaced before its CPU form runs; None: strict
    problem: str | None = None  # why it errs at the next check (an invalid annotation)
    eligible: Eligible | None = None  # its requirement's class; None: no requirement
    sent: str | None = None  # the worker it was last sent to
    fell_back: bool = False  # its CPU form runs
    due: float | None = None  # when a check looks at it; None: none will


class Fallback:
    """The GPU tasks' records, their fallback checks and timers, and what they wait for."""

    def __init__(
        self,
        scheduler: Scheduler,
        *,
        timeout: float | None,
        interval: float,
        grants: Grants,
        emit: Callable[..., None],
        active: Callable[[], bool],
        act: Callable[..., None],
        restarting: Callable[[WorkerState], bool] = lambda ws: False,
    ) -> None:
        self.scheduler = scheduler
        self._restarting = restarting  # whether accelsched drains the worker to restart it
        self.tasks: dict[Any, GpuTask] = {}  # task key -> its record: the only per-task state
        self.timeout = timeout  # the plugin's default: None, strict
        self._grants = grants
        self._unmet: set[str] = set()  # requirements said unmet, until a device meets them
        self._classes: WeakValueDictionary[ClassKey, Eligible] = WeakValueDictionary()
        self._facts: dict[str, list[DeviceFacts]] = {}  # worker -> its granted devices
        self._benched: dict[str, float] = {}  # worker -> when it is judged again
        # a deadline entry still counts while its task waits, due then
        self.deadlines = Deadlines(lambda key, at: getattr(self.tasks.get(key), "due", None) == at)
        self.notices = Notices()
        self._emit = emit
        self._active = active
        self._act = act  # PlacementPlugin.act: carries out the proposals of a check
        self._timer: tuple[float, Any] | None = None  # (deadline, handle)
        # read once, as the scheduler reads it; None once warned
        self._no_workers_limit = parse_timedelta(
            dask.config.get("distributed.scheduler.no-workers-timeout", None)
        )
        # elastic pools (accelsched.adapt): class -> until when a worker serving it was
        # said to be coming (monotonic), pools at their maximum, and the bound
        self._coming: dict[str, float] = {}
        self._full: dict[str, list[str]] = {}
        self._full_at = 0.0  # when elastic pools last said which are at their maximum
        self._bound = 0.0
        self.checks = 0  # checks completed (ticks and timers): "one ran since then"
        #: The pools ``accelsched.adapt`` sizes (its last word): worker ``<pool>-<n>``.
        self.pool_names: frozenset[str] = frozenset()
        internals.install_handler(scheduler, DEMAND_HANDLER, self.demand)
        internals.install_handler(scheduler, POOLS_HANDLER, self.pools)
        internals.start_periodic(scheduler, _PERIODIC, self.check, interval)
        internals.start_periodic(scheduler, _WAITING, self.tick, TICK)
        internals.wrap_handler(scheduler, "set_restrictions", self.set_restrictions)
        self._warn_no_workers(timeout)
        # GPU tasks already there (a plugin registered late, or again)
        for ts in list(scheduler.tasks.values()):
            restrictions = ts.resource_restrictions or {}
            if GPU in restrictions or GPU_MEMORY in restrictions:
                adopted = self.tasks[ts.key] = GpuTask(timeout)
                if ts.state not in DONE and REQUIREMENT_ANNOTATION in (ts.annotations or {}):
                    internals.share_worker_restriction(ts, None)  # its own: unknown now
                    self._require(ts, adopted, None, restrictions.get(GPU, 1), say=False)
        for ts in list(internals.unrunnable(scheduler)):
            if (task := self.tasks.get(ts.key)) is not None:
                self._enter(ts, task)

    def follow(self, worker: str) -> None:
        """``worker``'s grant changed (granted, offered again, or gone): every class it
        can serve now holds it, and no other."""
        if self._grants.of(worker).reported:
            self._facts[worker] = [facts_of(r) for r in self._grants.of(worker).devices]
        else:
            self._facts.pop(worker, None)
        for eligible in self._classes.values():
            if self._serves(worker, eligible.key):
                eligible.workers.add(worker)
                self._unmet.discard(eligible.key[0].label())
            else:
                eligible.workers.discard(worker)

    def _serves(self, worker: str, key: ClassKey, *, own: bool = True) -> bool:
        need, devices, restriction = key
        facts = self._facts.get(worker)
        return (
            facts is not None
            and (
                not own
                or restriction is None
                or worker in restriction
                or get_address_host(worker) in restriction  # its workers=["hostname"]
            )
            and sum(need.fits(f) for f in facts) >= devices
        )

    def close(self) -> None:
        internals.stop_periodic(self.scheduler, _PERIODIC)
        internals.stop_periodic(self.scheduler, _WAITING)
        internals.restore_handler(self.scheduler, "set_restrictions")
        internals.remove_handler(self.scheduler, DEMAND_HANDLER, self.demand)
        internals.remove_handler(self.scheduler, POOLS_HANDLER, self.pools)

    def set_restrictions(self, original: Callable[..., Any], worker: dict) -> None:
        """distributed's ``set_restrictions`` handler (``Client.set_restrictions``): a
        requirement task's new ``workers`` become its own restriction, met with its
        requirement's (distributed alone replaced the one by the other)."""
        if not self._active():
            return original(worker=worker)
        # each requirement task's class, and the hosts it named (taken off it): kept, as
        # distributed keeps a task's hosts when its workers are set
        named = {
            key: (
                task,
                task.eligible.key[1],
                {o for o in task.eligible.key[2] or () if "://" not in o},
            )
            for key in worker
            if (task := self.tasks.get(key)) is not None and task.eligible is not None
        }
        original(worker=worker)  # raises for a key it does not hold: all are held below
        for key, (task, devices, hosts) in named.items():
            ts = self.scheduler.tasks[key]
            task.eligible = None
            internals.restrict_to_own(ts, [*internals.restricted_to(ts), *hosts])
            self._require(ts, task, None, devices, say=False)
        # one may run now: distributed looks again only as workers come
        waiting = [key for key in named if self.scheduler.tasks[key].state == "no-worker"]
        internals.run_now(self.scheduler, waiting, f"accelsched-set-restrictions-{time()}")

    # --- hooks ---------------------------------------------------------------------------

    def prepare(self, keys: Any) -> None:
        """Prepare new GPU tasks (still ``released``, so editing them is safe).

        A task is a GPU task when it is annotated ``resources={"GPU": n}`` or calls a
        marked step (:mod:`accelsched.policy.marks`). An invalid annotation parks its task on an
        unsatisfiable resource; it errs at the next check, naming the value.
        """
        for key in keys or ():
            ts = self.scheduler.tasks.get(key)
            if ts is None or ts.state != "released" or key in self.tasks:
                continue  # a resubmitted task: placed already, or prepared already
            try:
                problem = self._prepare(ts)
            except Exception as exc:  # one odd task must not cost its neighbours theirs
                logger.exception("accelsched: could not prepare task %r", key)
                problem = f"accelsched could not read its annotations: {exc!r}"
            if problem is None:
                continue
            # it waits on an unsatisfiable resource and errs alone at the next check,
            # naming the value; only what distributed can compare stays beside it
            self.tasks.setdefault(ts.key, GpuTask(None)).problem = problem
            kept = {
                name: amount
                for name, amount in (ts.resource_restrictions or {}).items()
                if invalid_amount(amount) is None
            }
            internals.set_resource_restrictions(ts, {**kept, INVALID_RESOURCE: 1})

    def _prepare(self, ts: Any) -> str | None:
        """Make ``ts`` a GPU task if it is one; why it cannot be placed, or None."""
        # annotated or not, the marked steps it calls give its timeout and requirement
        mark = find_mark(internals.task_spec(ts))
        annotations = ts.annotations or {}
        if GPU_MEMORY in (ts.resource_restrictions or {}):
            # accelsched's own resource, set from a declared requirement (a new task has
            # none): named by hand, it would ask the worker for bytes but no device
            amount = ts.resource_restrictions[GPU_MEMORY]
            return (
                f"resources={{{GPU_MEMORY!r}: {amount!r:.40}}}: accelsched's own resource; "
                "declare a task's device memory with gpu={'memory': ...} beside "
                "resources={'GPU': 1}, or @accelsched.gpu(memory=...)"
            )
        if GPU not in (ts.resource_restrictions or {}):
            # no annotation (or fusion / query planning dropped it): a marked step?
            if mark is None:
                if (given := annotations.get(REQUIREMENT_ANNOTATION)) is not None:
                    return f"gpu={given!r:.80} on a task without resources={{'GPU': n}}"
                return None
            internals.set_resource_restrictions(
                ts, {**(ts.resource_restrictions or {}), GPU: mark.count}
            )
        internals.harden_restrictions(ts)
        amount = ts.resource_restrictions[GPU]
        if problem := (mark_problem(mark) if mark else None) or invalid_amount(amount):
            return problem
        try:
            timeout = task_timeout(self.timeout, annotations, mark)
        except ValueError as exc:
            return str(exc)
        task = self.tasks[ts.key] = GpuTask(timeout)
        if problem := self._require(ts, task, mark, amount):  # its device
            return problem
        if amount > MAX_GPUS and timeout is None:
            # strict, and no worker can ever take it: it errs alone, never sent anywhere
            never = f"no worker can ever offer more than {MAX_GPUS} GPUs"
            return f"resources={{'GPU': {amount!r}}}: {never}"
        self._warn_no_workers(timeout)
        return None

    def _require(
        self, ts: Any, task: GpuTask, mark: Mark | None, count: float, *, say: bool = True
    ) -> str | None:
        """Restrict a new GPU task by its requirement (its annotated one, and that of the
        marked step it calls) to the workers that can serve it; a problem to err it with,
        or None."""
        given = (ts.annotations or {}).get(REQUIREMENT_ANNOTATION)
        step = mark.requirement if mark is not None else None
        if given is None and step is None:
            return None
        try:
            need = parse_requirement(given)
            need = parse_requirement(combine([r for r in (need, step) if r]) or need)
        except ValueError as exc:
            return str(exc)
        if not need:
            return None
        if problem := device_count_problem(need, count):
            return problem
        # the requirement as the worker reads it back (plain, msgpack-safe values)
        internals.annotate(
            ts,
            REQUIREMENT_ANNOTATION,
            {
                "memory": need.memory,
                "model": need.model,
                "capability": None if need.capability is None else list(need.capability),
                "mig": need.mig,
                "enforce": need.enforce,
            },
        )
        if need.memory is not None:  # shares a device: memory, not a whole GPU
            kept = {k: v for k, v in ts.resource_restrictions.items() if k != GPU}
            internals.set_resource_restrictions(ts, {**kept, GPU_MEMORY: mebibytes(need.memory)})
            internals.drop_annotated_resource(ts, GPU)
        own = internals.restricted_to(ts) | internals.take_restricted_hosts(self.scheduler, ts)
        # enforce says nothing of the device: tasks that differ by it share a class
        key = (replace(need, enforce=None), devices_needed(count), frozenset(own) if own else None)
        if (eligible := self._classes.get(key)) is None:
            workers = {w for w in self._facts if self._serves(w, key)}
            eligible = self._classes[key] = Eligible(key, {NOWHERE, *workers})
            # no device in the cluster meets it (on any worker): said once, until one does
            if (label := need.label()) not in self._unmet and not any(
                self._serves(w, key, own=False) for w in self._facts
            ):
                self._unmet.add(label)
                if say:
                    # (a device's whole memory is not what a task may declare on it)
                    most = max(
                        (capacity(f.memory) for fs in self._facts.values() for f in fs),
                        default=None,
                    )
                    self._emit(
                        events.UNMET_REQUIREMENT,
                        None,
                        requirement=label,
                        key=str(ts.key),
                        declarable=most,
                    )
        task.eligible = eligible
        internals.share_worker_restriction(ts, eligible.workers)
        return None

    def transition(self, key: Any, start: str, finish: str, stimulus_id: str) -> None:
        """Forget a forgotten task; time a task that becomes unrunnable.

        Runs inside the transition loop for every task, so it only does O(1) bookkeeping
        (and O(log n) for a timed task entering ``no-worker``) and schedules a check.
        """
        if (task := self.tasks.get(key)) is None:
            return  # no GPU task
        if finish == "forgotten":
            del self.tasks[key]  # the one place a task is forgotten (its class with it)
            return
        ts = self.scheduler.tasks[key]  # not forgotten: still the scheduler's
        if finish == "no-worker":
            self._enter(ts, task)
        elif start == "no-worker":
            task.due = None
        if task.eligible is None:  # no requirement
            return
        # note where it was sent; one its worker sent back (no device there can hold it
        # now) goes elsewhere, or waits
        if finish == "processing":
            task.sent = ts.processing_on.address if ts.processing_on else task.sent
        elif start == "processing" and stimulus_id.startswith(_SENT_BACK):
            # (it was sent there: a task reaches processing first, where this is set)
            ws = self.scheduler.workers.get(task.sent or "")
            if ws is not None and ws.status in (Status.running, Status.paused):  # no drain
                task.eligible.workers.discard(ws.address)
                self._benched[ws.address] = monotonic() + BENCH

    def _enter(self, ts: Any, task: GpuTask) -> None:
        """``ts`` just became unrunnable: note when a check looks at it."""
        if task.problem is not None:
            self._due(ts.key, task, internals.unrunnable(self.scheduler)[ts])
        elif not task.fell_back and (w := self._waiting(ts, task)) is not None:
            self._due(ts.key, task, deadline(w))

    def _waiting(self, ts: Any, task: GpuTask) -> Waiting | None:
        """``ts`` as :func:`~accelsched.policy.timeouts.sweep` sees it (None: it waits for
        ever). Only a task that has not fallen back gets here: it asks for GPUs, or for
        ``GPU-memory`` on one device."""
        if task.timeout is None:
            return None
        amount = (ts.resource_restrictions or {}).get(GPU, 1)
        chain = any(
            (d := self.tasks.get(dep.key)) is not None and d.fell_back for dep in ts.dependencies
        )
        since = internals.unrunnable(self.scheduler)[ts]  # when it became unrunnable
        if self._coming:  # a worker that serves it is starting: its timeout counts after
            since = counted_from(since, self._coming.get(self.class_of(ts, task)[0]), self._bound)
        return Waiting(ts.key, since, amount, task.timeout, chain)

    def class_of(self, ts: Any, task: GpuTask) -> tuple[str, Requirement, int]:
        """The class of a GPU task as elastic pools see it: its name
        (``"<devices>x <requirement>"``), requirement and devices."""
        need, devices, _ = (
            task.eligible.key
            if task.eligible is not None
            else (Requirement(), devices_needed((ts.resource_restrictions or {}).get(GPU, 1)), None)
        )
        return f"{devices}x {need.label()}", need, devices

    def _due(self, key: Hashable, task: GpuTask, at: float | None) -> None:
        task.due = at
        if at is not None:
            self.deadlines.add(key, at)
            self._schedule()

    # --- the check -----------------------------------------------------------------------

    def check(self) -> None:
        """Run the CPU form of GPU tasks unrunnable past their timeout; err invalid ones.

        Pops only the tasks whose deadline passed (:class:`~accelsched.policy.timeouts.Deadlines`),
        asks the policy about them and hands what it answers to the plugin, which acts.
        """
        if not self._active():
            return  # unregistered or replaced; its timers may still fire
        now = monotonic()
        errs: list[Proposal] = []
        waiting: list[Waiting] = []
        tasks: dict[Any, Any] = self.scheduler.tasks  # keys as the heap carries them
        for key in self.deadlines.pop_due(now):
            task, ts = self.tasks[key], tasks[key]  # live: waits in no-worker
            task.due = None
            if task.problem is not None:  # kept: a retry errs again
                errs.append(Proposal("err", key, task.problem))
            elif (w := self._waiting(ts, task)) is not None:
                waiting.append(w)
        try:
            if errs or waiting:
                proposals, later = sweep(
                    waiting, now=now, largest=internals.largest_gpu_count(self.scheduler)
                )
                for key, at in later.items():  # due but kept waiting (a chain with GPUs now)
                    self._due(key, self.tasks[key], at)
                self._act(errs + proposals)
        finally:  # whatever befell this one, the next check is timed (its tasks are popped)
            self._schedule()
            self.checks += 1

    def still_unrunnable(self, key: Any) -> bool:
        """Whether the GPU task ``key`` still waits in ``no-worker``, where a check found it
        (acting on one task of a check can release another: erring a task errs its
        dependents, and a dependency nobody waits for then is released)."""
        ts = self.scheduler.tasks.get(key)
        return ts is not None and ts.state == "no-worker" and key in self.tasks

    def fall_back(self, proposals: list[Proposal]) -> None:
        """Run these unrunnable GPU tasks' CPU form now (the plugin's ``fall-back``).

        Each loses its GPU restriction and is marked with the reason; the check's events
        are summarised (:func:`~accelsched.policy.timeouts.summarise`) and the tasks are
        sent on together.
        """
        tasks: dict[Any, Any] = self.scheduler.tasks  # keys as the proposals carry them
        # (an err acted on before them in the same batch may have released some: their
        # dependents erred, nobody waits for them now)
        proposals = [p for p in proposals if self.still_unrunnable(p.subject)]
        if monotonic() - self._full_at > FULL_SAID_FOR:  # the pools stopped saying so
            self._full = {}
        full: set[str] = set()  # the pools at their maximum that could have served them
        for p in proposals:
            ts, task = tasks[p.subject], self.tasks[p.subject]
            full.update(self._full.get(self.class_of(ts, task)[0], ()) if self._full else ())
            internals.set_resource_restrictions(
                ts,
                {k: v for k, v in ts.resource_restrictions.items() if k not in (GPU, GPU_MEMORY)},
            )
            if task.eligible is not None:  # runs wherever its own restriction allows
                internals.restrict_to_own(ts, task.eligible.key[2])
                task.eligible = None  # where it was sent counts no more
            # the worker gets the annotations too: the GPU amount it no longer needs goes,
            # so none can break the message (an int past 2**64 cost every worker its stream)
            internals.drop_annotated_resource(ts, GPU)
            internals.annotate(ts, FALLBACK_ANNOTATION, p.reason)
            task.fell_back = True
        for figures in summarise(proposals, FALLBACK_DETAIL):
            if full:  # elastic pools: those that could have served them are at maximum
                figures["pools_at_maximum"] = sorted(full)
            self._emit(events.FALLBACK, None, **figures)
        stimulus_id = f"accelsched-fallback-{time()}"
        internals.run_now(self.scheduler, [p.subject for p in proposals], stimulus_id)

    # --- when the next check runs -------------------------------------------------------

    def _schedule(self) -> None:
        """Check at the next deadline (at once when it passed), one timer at a time (the
        earliest), so a fallback comes close to its timeout, not a tick past it."""
        at = self.deadlines.next_deadline()
        if at is None or (self._timer is not None and self._timer[0] <= at):
            return
        if self._timer is not None:
            self.scheduler.loop.remove_timeout(self._timer[1])

        def fire() -> None:
            self._timer = None
            self.check()

        self._timer = (at, self.scheduler.loop.call_later(max(0.0, at - monotonic()) + 0.001, fire))

    def _warn_no_workers(self, timeout: float | None) -> None:
        """Warn once when distributed's ``no-workers-timeout`` would fail unplaced tasks
        before they could fall back."""
        limit = self._no_workers_limit
        if timeout is not None and limit is not None and limit < timeout:
            self._no_workers_limit = None  # said: once is enough
            logger.warning(  # one line in the scheduler's log, not also a warning
                "distributed.scheduler.no-workers-timeout (%ss) is shorter than accelsched's "
                "fallback timeout (%ss): the scheduler will fail unplaceable GPU tasks with "
                "NoValidWorkerError before they can fall back",
                limit,
                timeout,
            )

    # --- what waits ----------------------------------------------------------------------

    def waiting(self) -> dict[str, list[Any]]:
        """The keys of GPU tasks unplaced long enough to count, by why."""
        now = monotonic()
        largest = internals.largest_gpu_count(self.scheduler)
        out: dict[str, list[Any]] = {}
        unmet: dict[ClassKey, bool] = {}  # per requirement class: no device anywhere meets it
        for ts, since in list(internals.unrunnable(self.scheduler).items()):
            task = self.tasks.get(ts.key)
            if task is None or task.problem is not None or task.fell_back:
                continue  # no GPU task (any more); or invalid, erred at the next check
            if now - since >= NOTICE_AFTER:
                amount = (ts.resource_restrictions or {}).get(GPU) or 0
                key = None if task.eligible is None else task.eligible.key
                if key is not None and key not in unmet:
                    unmet[key] = not any(self._serves(w, key, own=False) for w in self._facts)
                reason = reason_for(amount, largest, key is not None and unmet[key])
                out.setdefault(reason, []).append(ts.key)
        return out

    def tick(self) -> None:
        """Judge benched workers again; say each reason tasks newly wait for, once (a
        ``gpu-waiting`` event)."""
        if not self._active():
            return
        now = monotonic()
        for worker in [w for w, at in self._benched.items() if at <= now]:
            del self._benched[worker]  # judged again, as if its devices were offered again
            self.follow(worker)
            if (ws := self.scheduler.workers.get(worker)) is not None:
                internals.offer_unrunnable(self.scheduler, ws)
        waiting = self.waiting()
        for reason in self.notices.update(waiting):
            self._emit(
                events.GPU_WAITING,
                None,
                reason=reason,
                waiting=len(waiting[reason]),
                keys=[str(k) for k in waiting[reason][:EXAMPLES]],
            )

    # --- what elastic pools ask ---------------------------------------------------------

    def demand(self, comm: Any = None) -> DemandReply:
        """The ``accelsched_demand`` reply: the work waiting and running, by GPU class."""
        gpu: dict[str, ClassDemand] = {}
        cpu_tasks, cpu_seconds = 0, 0.0
        for ts, seconds in internals.ready_tasks(self.scheduler):
            task = self.tasks.get(ts.key)
            if task is None or task.fell_back or task.problem is not None:
                cpu_tasks += 1
                cpu_seconds += seconds
                continue
            name, need, devices = self.class_of(ts, task)
            if (entry := gpu.get(name)) is None:
                entry = gpu[name] = {
                    "name": name,
                    "requirement": {
                        "memory": need.memory,
                        "model": need.model,
                        "capability": None if need.capability is None else list(need.capability),
                        "mig": need.mig,
                    },
                    "devices": devices,
                    "waiting": 0,
                    "running": 0,
                    "seconds": 0.0,
                }
            entry["waiting" if ts.state == "no-worker" else "running"] += 1
            entry["seconds"] += seconds
        return {
            "status": "OK",
            "gpu": list(gpu.values()),
            "cpu_tasks": cpu_tasks,
            "cpu_seconds": cpu_seconds,
            "workers": [
                {
                    "name": str(ws.name),
                    "address": ws.address,
                    "busy": busy,
                    "gpu_busy": gpu_busy,
                    "gpus": len(self._grants.uuids(ws.address)),
                    "retiring": internals.retiring(ws) and not self._restarting(ws),
                    "running": internals.in_service(ws),
                    "holds": internals.holds_results(ws),
                }
                for ws in self.scheduler.workers.values()
                for busy, gpu_busy in [internals.busy(ws)]
            ],
        }

    def pools(
        self,
        comm: Any = None,
        coming: Any = None,
        full: Any = None,
        bound: Any = 0.0,
        pools: Any = None,
    ) -> dict[str, str]:
        """``accelsched_pools``: checked here (anyone connected may call it)."""
        try:
            c = {str(k): _seconds(v) for k, v in dict(coming or {}).items()}
            f = {str(k): [str(p) for p in _names(v)] for k, v in dict(full or {}).items()}
            b = _seconds(bound)
            names = None if pools is None else frozenset(str(p) for p in _names(pools))
        except (TypeError, ValueError):
            return {"status": "invalid"}
        # which classes a starting worker serves, for how many more seconds (c), and
        # which wait on pools at their maximum (f); a promise once made keeps counting
        # for the tasks that waited then (counted_from), at most b seconds past when
        # each became unrunnable, however long their timeouts: it is kept (one past
        # holds back no task that became unrunnable after it), the latest few classes
        now = monotonic()
        self._bound = b
        coming = self._coming | {n: max(self._coming.get(n, 0.0), now + s) for n, s in c.items()}
        if len(coming) > _CLASSES_KEPT:  # (anyone may name classes: not without end)
            coming = dict(sorted(coming.items(), key=lambda nu: nu[1])[-_CLASSES_KEPT:])
        self._coming = coming
        self._full, self._full_at = f, now
        if names is not None:
            self.pool_names = names
        return {"status": "OK"}

    def pool_of(self, worker: str) -> str | None:
        """The pool of the worker named ``worker`` (``<pool>-<n>``), None outside any."""
        pool, _, n = worker.rpartition("-")
        return pool if n.isdigit() and pool in self.pool_names else None


#: Longest a starting worker may hold a task's fallback back, whatever a caller says.
MAX_BOUND = 3600.0


def _names(value: Any) -> list[Any] | tuple[Any, ...]:
    """A list of pool names (a tuple, as distributed's msgpack reads one); a string is
    no list of them."""
    if not isinstance(value, (list, tuple)):
        raise TypeError(value)
    return value


def _seconds(value: Any) -> float:
    """A number of seconds between 0 and :data:`MAX_BOUND`; ValueError otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1e9:
        raise ValueError(value)
    return min(float(value), MAX_BOUND)
