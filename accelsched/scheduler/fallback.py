"""CPU fallback on the scheduler: carrying out what :mod:`accelsched.policy.timeouts` decides.

New GPU tasks are prepared in ``update_graph`` (their restriction made hard, their
``fallback_timeout`` annotation read). A GPU task with a timeout that becomes unrunnable
enters :class:`~accelsched.policy.timeouts.Deadlines` with the time it may fall back; a check
pops only the tasks that are due and asks :func:`accelsched.policy.timeouts.sweep` which fall
back now. Its ``fall-back`` proposals go to the scheduler's actor
(:mod:`accelsched.scheduler.scheduler_actor`), which has :meth:`Fallback.fall_back` lift their GPU
restriction (marking them, so the worker copies their device inputs to the host) and
send them on. A check costs what is due, not what waits: nothing when no task has a
timeout, O(k log n) for k due of n waiting. Checks run exactly at the next deadline,
with a periodic tick as a safety net.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from time import monotonic, time
from typing import TYPE_CHECKING, Any

from accelsched import events, internals
from accelsched.policy.marks import find_mark, mark_problem
from accelsched.policy.proposals import Proposal
from accelsched.policy.timeouts import (
    MAX_GPUS,
    Deadlines,
    FallbackPolicy,
    Waiting,
    invalid_amount,
    parse_task_timeout,
    satisfiable,
    summarise,
    sweep,
)
from accelsched.protocol import (
    FALLBACK_ANNOTATION,
    GPU,
    GPU_MEMORY,
    INVALID_RESOURCE,
    REQUIREMENT_ANNOTATION,
    TIMEOUT_ANNOTATION,
)
from accelsched.scheduler.check_timer import CheckTimer, NoWorkersWarning

if TYPE_CHECKING:
    from distributed import Scheduler

    from accelsched.policy.proposals import Act
    from accelsched.scheduler.eligibility import Eligibility

__all__ = ["Fallback"]

logger = logging.getLogger(__name__)

_PERIODIC = "accelsched-fallback"

UNSATISFIABLE_TEXT = f"no worker can ever offer more than {MAX_GPUS} GPUs"

#: A check that falls back more tasks than this logs one summary event, not one each.
FALLBACK_DETAIL = 10


class Fallback:
    """Per-task timeouts, the fallback checks and their timers."""

    def __init__(
        self,
        *,
        timeout: float | None,
        interval: float,
        emit: Callable[..., None],
        active: Callable[[], bool],
        act: Act,
        eligibility: Eligibility,
    ) -> None:
        self.scheduler: Scheduler | None = None
        self.eligibility = eligibility  # tasks with requirements: where they may run
        self.policy = FallbackPolicy(timeout)
        self.interval = interval
        self.timeouts: dict[Any, float | None] = {}  # key -> annotated timeout
        self.invalid: dict[Any, str] = {}  # key -> why its annotation is invalid
        self.fell_back: set[Any] = set()  # keys that fell back for lack of GPUs
        self.deadlines = Deadlines()  # unrunnable tasks that may fall back, by deadline
        self._timer = CheckTimer(self.check)
        self._no_workers = NoWorkersWarning()
        self._emit = emit
        self._active = active
        self._act = act
        self.checks = 0  # checks completed (ticks and timers): "one ran since then"

    def start(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self._timer.start(scheduler)
        internals.start_periodic(scheduler, _PERIODIC, self.check, self.interval)
        self._no_workers.check(self.policy.default)
        # tasks already unrunnable when the plugin arrives (registered late, re-registered)
        for ts, since in list(internals.unrunnable(scheduler).items()):
            self._enter(ts.key, since)
        self._schedule()

    def close(self) -> None:
        if self.scheduler is not None:
            internals.stop_periodic(self.scheduler, _PERIODIC)

    # --- hooks ---------------------------------------------------------------------------

    def prepare(self, scheduler: Scheduler, keys: Any) -> None:
        """Prepare new GPU tasks (still ``released``, so editing them is safe).

        A task is a GPU task when it is annotated ``resources={"GPU": n}`` or calls a
        marked step (:mod:`accelsched.policy.marks`). An invalid annotation parks its task on an
        unsatisfiable resource; it errs at the next check, naming the value.
        """
        for key in keys or ():
            try:
                self._prepare_one(scheduler.tasks.get(key))
            except Exception as exc:  # one odd task must not cost its neighbours theirs
                logger.exception("accelsched: could not prepare task %r", key)
                ts = scheduler.tasks.get(key)
                if ts is not None and ts.state == "released":
                    self._park(ts, f"accelsched could not read its annotations: {exc!r}")

    def _prepare_one(self, ts: Any) -> None:
        if ts is None or ts.state != "released":  # a resubmitted task already placed
            return
        # annotated or not, the marked steps it calls give its timeout and requirement
        mark = find_mark(internals.task_spec(ts))
        if GPU not in (ts.resource_restrictions or {}):
            # no annotation (or fusion / query planning dropped it): a marked step?
            if mark is None:
                if (given := (ts.annotations or {}).get(REQUIREMENT_ANNOTATION)) is not None:
                    self._park(ts, f"gpu={given!r:.80} on a task without resources={{'GPU': n}}")
                return
            internals.set_resource_restrictions(
                ts, {**(ts.resource_restrictions or {}), GPU: mark.count}
            )
        internals.harden_restrictions(ts)
        amount = ts.resource_restrictions[GPU]
        problem = (mark_problem(mark) if mark else None) or invalid_amount(amount)
        if problem is not None:
            self._park(ts, problem)
            return
        annotations = ts.annotations or {}
        if TIMEOUT_ANNOTATION in annotations:
            try:
                timeout = parse_task_timeout(annotations[TIMEOUT_ANNOTATION])
            except ValueError as exc:
                self._park(ts, str(exc))
                return
            self.timeouts[ts.key] = timeout
        elif mark is not None and mark.timeout_given:  # the step's own timeout
            self.timeouts[ts.key] = mark.timeout
        elif mark is not None and mark.cpu_form is not None and self.policy.default is None:
            self.timeouts[ts.key] = mark.cpu_form  # a dual step: it has a CPU form
        problem = self.eligibility.prepare(ts, mark, amount, looked=True)  # its device
        if problem is not None:
            self._park(ts, problem)
            return
        if not satisfiable(amount) and self.timeout_of(ts.key) is None:
            # strict, and no worker can ever take it: it errs alone, never sent anywhere
            self._park(ts, f"resources={{'GPU': {amount!r}}}: {UNSATISFIABLE_TEXT}")
            return
        if ts.key in self.timeouts:
            self._no_workers.check(self.timeouts[ts.key])

    def _park(self, ts: Any, problem: str) -> None:
        """An invalid task waits on an unsatisfiable resource and errs alone at the next
        check, naming the value; its neighbours keep their own annotations."""
        self.invalid[ts.key] = problem
        # only what distributed can compare stays beside the unsatisfiable resource
        kept = {
            name: amount
            for name, amount in (ts.resource_restrictions or {}).items()
            if invalid_amount(amount) is None
        }
        internals.set_resource_restrictions(ts, {**kept, INVALID_RESOURCE: 1})

    def transition(self, key: Any, start: str, finish: str) -> None:
        """Forget a forgotten task; time a task that becomes unrunnable.

        Runs inside the transition loop for every task, so it only does O(1) bookkeeping
        (and O(log n) for a timed task entering ``no-worker``) and schedules a check.
        """
        if finish == "no-worker":
            if self.policy.default is None and not self.timeouts and not self.invalid:
                return  # no task has a timeout: nothing to time
            self._enter(key, monotonic())
            self._schedule()
        elif start == "no-worker":
            self.deadlines.discard(key)
        if finish == "forgotten":
            self.eligibility.forget(key)
            self.timeouts.pop(key, None)
            self.invalid.pop(key, None)
            self.fell_back.discard(key)

    def _enter(self, key: Any, since: float) -> None:
        """``key`` is unrunnable since ``since``: note when it may fall back (or err)."""
        if key in self.invalid:
            self.deadlines.add(key, since, since)
            return
        timeout = self.timeout_of(key)
        if timeout is None:
            return
        ts = self.scheduler.tasks.get(key) if self.scheduler is not None else None
        at_once = False  # waiting cannot help, or a chain: decided at once
        if ts is not None:
            unsatisfiable = not satisfiable((ts.resource_restrictions or {}).get(GPU, 0))
            chain = bool(timeout and self.fell_back) and any(
                d.key in self.fell_back for d in ts.dependencies
            )
            at_once = unsatisfiable or chain
        self.deadlines.add(key, since, since if at_once else since + timeout)

    def timeout_of(self, key: Any) -> float | None:
        """The task's annotated timeout, else the default (the policy's rule)."""
        if key in self.timeouts:
            return self.policy.timeout(self.timeouts[key])
        return self.policy.timeout()

    # --- the check -----------------------------------------------------------------------

    def check(self) -> None:
        """Run the CPU form of GPU tasks unrunnable past their timeout; err invalid ones.

        Pops only the tasks whose deadline passed (:class:`~accelsched.policy.timeouts.Deadlines`).
        """
        self._timer.checking()
        scheduler = self.scheduler
        if scheduler is None or not self._active():
            return  # unregistered or replaced; its timers may still fire
        now = monotonic()
        due = self.deadlines.pop_due(now)
        if due:
            self._decide(scheduler, due, now)
        self._schedule()
        self.checks += 1

    def _decide(self, scheduler: Scheduler, due: list[tuple[Any, float]], now: float) -> None:
        stimulus_id = f"accelsched-fallback-{time()}"
        waiting: list[Waiting] = []
        for key, since in due:
            ts = scheduler.tasks.get(key)
            if ts is None or ts.state != "no-worker":
                continue
            if key in self.invalid:  # kept: a retry errs again
                internals.fail_task(
                    scheduler, key, ValueError(f"task {key!r}: {self.invalid[key]}"), stimulus_id
                )
                continue
            restrictions = ts.resource_restrictions or {}
            amount = restrictions.get(GPU) or (1 if restrictions.get(GPU_MEMORY) else 0)
            if not amount:
                continue
            waiting.append(
                Waiting(
                    key,
                    since,
                    amount,
                    self.timeout_of(key),
                    any(d.key in self.fell_back for d in ts.dependencies),
                )
            )
        proposals, _ = sweep(
            self.policy, waiting, now=now, largest=internals.largest_gpu_count(scheduler)
        )
        fell = {p.subject for p in proposals}
        for w in waiting:  # due but kept waiting (a chain with GPUs now): its own deadline
            if w.key not in fell and w.timeout is not None:
                self.deadlines.add(w.key, w.since, max(now, w.since + w.timeout))
        self._act(proposals)

    def fall_back(self, proposals: list[Proposal]) -> None:
        """Run these unrunnable GPU tasks' CPU form now (the actor's ``fall-back``).

        Each loses its GPU restriction and is marked with the reason; the check's events
        are summarised (:func:`~accelsched.policy.timeouts.summarise`) and the tasks are
        sent on together.
        """
        scheduler = self.scheduler
        assert scheduler is not None
        tasks: dict[Any, Any] = scheduler.tasks  # keys as the proposals carry them
        for p in proposals:
            ts = tasks[p.subject]
            restrictions = dict(ts.resource_restrictions)
            restrictions.pop(GPU, None)
            restrictions.pop(GPU_MEMORY, None)
            internals.set_resource_restrictions(ts, restrictions)
            self.eligibility.fell_back(ts)
            # the worker gets the annotations too: the GPU amount it no longer needs goes,
            # so none can break the message (an int past 2**64 cost every worker its stream)
            internals.drop_annotated_resource(ts, GPU)
            internals.annotate(ts, FALLBACK_ANNOTATION, p.reason)
            self.fell_back.add(ts.key)
        for figures in summarise(proposals, FALLBACK_DETAIL):
            self._emit(events.FALLBACK, None, **figures)
        stimulus_id = f"accelsched-fallback-{time()}"
        internals.run_now(scheduler, [p.subject for p in proposals], stimulus_id)

    def _schedule(self) -> None:
        """Check at the next deadline (at once when it passed)."""
        self._timer.at(self.deadlines.next_deadline())
