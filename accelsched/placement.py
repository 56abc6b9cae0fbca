"""PlacementPlugin: the scheduler side of accelsched.

distributed treats ``resources={"GPU": n}`` as a label a worker declares. This plugin
makes the label mean something:

- **Gate.** A worker's ``GPU`` resource counts only once its GuardPlugin has probed the
  devices through NVML and reported them (``accelsched_inventory``). Workers register
  before their plugins run, so the declared value is stripped at registration and every
  later ``set_resources`` is clamped to what was granted.
- **Exclusivity.** Two workers never own the same GPU UUID unless ``share_gpus``.
- **Re-offer.** When a worker's verified GPUs arrive, ``no-worker`` GPU tasks are offered
  to it at once (distributed does not do this on ``set_resources``).
- **CPU fallback.** A GPU task unrunnable past its ``fallback_timeout`` loses its GPU
  restriction and runs anywhere (its ``dual`` CPU form); see :mod:`accelsched.fallback`.
- **Lossless restarts.** A worker's guard may ask (``accelsched_restart``) to be
  restarted; the plugin lets its executing tasks finish, retires it (its data moves to
  peers), checks that worked, then restarts it through its nanny. When that cannot be
  done without loss, or past the restart budget, the worker's GPUs are quarantined.
- **Hard GPU restrictions.** ``allow_other_workers`` on a GPU task would let distributed
  place it on a GPU-less worker, where ``acquire_resources`` raises and the task wedges;
  here the soft worker preference is dropped and the GPU restriction stays hard.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import warnings
from time import monotonic, time
from typing import TYPE_CHECKING, Any

import dask.config
from distributed.core import Status
from distributed.diagnostics.plugin import SchedulerPlugin
from distributed.protocol import pickle
from tornado.ioloop import PeriodicCallback

from accelsched import events, metrics
from accelsched.budget import RestartBudget
from accelsched.config import PLACEMENT_OPTIONS, resolve_options
from accelsched.fallback import FallbackPolicy, parse_task_timeout
from accelsched.inventory import OwnershipRegistry

if TYPE_CHECKING:
    from distributed import Scheduler
    from distributed.scheduler import WorkerState

__all__ = ["PlacementPlugin", "GPU"]

logger = logging.getLogger(__name__)

GPU = "GPU"
INVENTORY_HANDLER = "accelsched_inventory"
RESTART_HANDLER = "accelsched_restart"
GUARD_NAME = "accelsched-guard"
#: How long a restart waits for the worker's executing tasks before giving up.
DRAIN_TIMEOUT = 300.0
#: Annotation the scheduler puts on a task that fell back (value: the reason).
FALLBACK_ANNOTATION = "accelsched_fallback"
#: Task annotation overriding the plugin's default fallback timeout.
TIMEOUT_ANNOTATION = "fallback_timeout"
_ORIGINAL = "__accelsched_original__"
_CALLBACK = "accelsched-fallback"
#: An unsatisfiable resource parking tasks with an invalid annotation until they err.
_INVALID = "accelsched-invalid-annotation"


class PlacementPlugin(SchedulerPlugin):
    """Verification gate, strict GPU placement, CPU fallback and restart coordination.

    Options (each also dask config under ``accelsched.placement.``, see
    ``docs/configuration.md``): ``fallback_timeout``, ``fallback_interval``,
    ``share_gpus``, ``max_restarts``, ``restart_window``, ``max_concurrent_restarts``.
    Invalid values raise ``ValueError``/``TypeError`` here, on the client.
    """

    name = "accelsched-placement"

    def __init__(self, **options: Any) -> None:
        self.options = resolve_options(PLACEMENT_OPTIONS, options, type(self).__name__)
        self._init_state()

    def _init_state(self) -> None:
        self.scheduler: Scheduler | None = None
        self.registry = OwnershipRegistry(share=self.options["share_gpus"])
        self.inventory: dict[str, list[dict[str, Any]]] = {}  # worker -> granted devices
        self.granted: dict[str, int] = {}  # worker -> GPU count it may advertise
        self.tokens: dict[str, str] = {}  # worker -> secret for requests it makes
        self.policy = FallbackPolicy(self.options["fallback_timeout"])
        self.timeouts: dict[Any, float | None] = {}  # key -> annotated timeout
        self.invalid: dict[Any, str] = {}  # key -> why its annotation is invalid
        self.fell_back: set[Any] = set()  # keys that fell back for lack of GPUs
        self._check_soon = False
        self._timer: Any = None  # (deadline, handle) of the next precise check
        self._warned_no_workers = False
        self.budget = RestartBudget(
            self.options["max_restarts"],
            self.options["restart_window"],
            self.options["max_concurrent_restarts"],
        )
        self.quarantined: dict[str, str] = {}  # worker -> reason
        self.refused: dict[str, set[str]] = {}  # worker -> UUIDs it was refused
        self.deferred: dict[str, str] = {}  # worker -> reason of its last deferral
        self._retire_lock = asyncio.Lock()

    def __getstate__(self) -> dict[str, Any]:
        # Only the options travel to the scheduler; state is rebuilt there.
        return {"options": self.options}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.options = state["options"]
        self._init_state()

    # --- SchedulerPlugin hooks ----------------------------------------------------------

    async def start(self, scheduler: Scheduler) -> None:
        """Install the gate and strip every worker's GPUs until its guard reports.

        Runs again when the plugin is re-registered: the previous instance's handlers are
        replaced here, never stacked.
        """
        self.scheduler = scheduler
        scheduler.handlers[INVENTORY_HANDLER] = self._handle_inventory
        scheduler.handlers[RESTART_HANDLER] = self._handle_restart
        original = scheduler.handlers["set_resources"]
        original = getattr(original, _ORIGINAL, original)

        def set_resources(worker: str, resources: dict | None = None) -> str:
            if not self._active():  # unregistered: distributed's own behaviour again
                return original(worker=worker, resources=resources)
            return self._gated_set_resources(original, worker, resources)

        setattr(set_resources, _ORIGINAL, original)
        scheduler.handlers["set_resources"] = set_resources
        for ws in list(scheduler.workers.values()):
            self._set_gpu(ws, 0)
        old = scheduler.periodic_callbacks.pop(_CALLBACK, None)
        if old is not None:
            old.stop()
        pc = PeriodicCallback(self.check_fallback, self.options["fallback_interval"] * 1000)
        scheduler.periodic_callbacks[_CALLBACK] = pc
        pc.start()
        self._warn_no_workers_timeout(self.policy.default)
        # Guards already running report again now that someone listens. (A guard
        # registered later reports from its own setup.)
        if GUARD_NAME in getattr(scheduler, "worker_plugins", {}):
            for addr in list(scheduler.workers):
                scheduler._ongoing_background_tasks.call_soon(self._ask_report, addr)

    def _active(self) -> bool:
        """Whether this instance is the registered one (``unregister_scheduler_plugin``
        neither closes a plugin nor removes what its ``start`` installed)."""
        return self.scheduler is not None and self.scheduler.plugins.get(self.name) is self

    async def _ask_report(self, addr: str) -> None:
        assert self.scheduler is not None
        try:
            await self.scheduler.rpc(addr).accelsched_report()
        except Exception as exc:  # a worker without the GuardPlugin, or gone
            logger.debug("accelsched: %s did not report its GPUs: %r", addr, exc)

    def add_worker(self, scheduler: Scheduler, worker: str) -> None:
        """Strip the declared GPU count: it counts only once the worker's guard reports.

        Runs before distributed offers ``no-worker`` tasks to the new worker, so nothing
        reaches it on the strength of a declaration.
        """
        ws = scheduler.workers[worker]
        self._set_gpu(ws, self.granted.get(worker, 0))

    def remove_worker(self, scheduler: Scheduler, worker: str, **kwargs: Any) -> None:
        """Free the worker's GPUs for the next claimant and forget its grant.

        Workers that were refused one of those GPUs are asked to report again, so a GPU
        whose owner left does not sit unused.
        """
        freed = set(self.registry.release(worker))
        self.refused.pop(worker, None)
        for other, uuids in list(self.refused.items()):
            if uuids & freed and other in scheduler.workers:
                scheduler._ongoing_background_tasks.call_soon(self._ask_report, other)
        self.inventory.pop(worker, None)
        self.granted.pop(worker, None)
        self.tokens.pop(worker, None)
        self.quarantined.pop(worker, None)
        self.deferred.pop(worker, None)
        self._update_gpu_gauge()

    async def close(self) -> None:
        if self.scheduler is not None:
            pc = self.scheduler.periodic_callbacks.get(_CALLBACK)
            if pc is not None:
                pc.stop()

    def update_graph(
        self, scheduler: Scheduler, *, tasks: list | None = None, **kwargs: Any
    ) -> None:
        """Prepare new GPU tasks (still ``released`` here, so editing them is safe).

        Makes their GPU restriction hard and reads their ``fallback_timeout``
        annotation. A task whose annotation is invalid is parked on an unsatisfiable
        resource and errs at the next fallback check, naming the value.
        """
        for key in tasks or ():
            ts = scheduler.tasks.get(key)
            if (
                ts is None
                or ts.state != "released"  # a resubmitted task already placed: leave it
                or not ts.resource_restrictions
                or GPU not in ts.resource_restrictions
            ):
                continue
            if ts.loose_restrictions:
                ts.loose_restrictions = False
                ts.worker_restrictions = None
                ts.host_restrictions = None
            annotations = ts.annotations or {}
            if TIMEOUT_ANNOTATION not in annotations:
                continue
            try:
                timeout = parse_task_timeout(annotations[TIMEOUT_ANNOTATION])
            except ValueError as exc:
                self.invalid[key] = str(exc)
                ts.resource_restrictions = {**ts.resource_restrictions, _INVALID: 1}
                continue
            self.timeouts[key] = timeout
            self._warn_no_workers_timeout(timeout)

    def transition(self, key: Any, start: str, finish: str, *args: Any, **kwargs: Any) -> None:
        """Forget per-task state; look at a task entering ``no-worker`` soon.

        Runs inside the transition loop, so it only schedules work.
        """
        if finish == "forgotten":
            self.timeouts.pop(key, None)
            self.invalid.pop(key, None)
            self.fell_back.discard(key)
        elif (
            finish == "no-worker"
            and not self._check_soon
            and self.scheduler is not None
            and (key in self.invalid or self._timeout_of(key) is not None)
        ):
            self._check_soon = True
            self.scheduler.loop.add_callback(self.check_fallback)

    # --- fallback -----------------------------------------------------------------------

    def check_fallback(self) -> None:
        """Run the CPU form of GPU tasks unrunnable past their timeout.

        Looks only at tasks in ``no-worker`` (``scheduler.unrunnable``): its cost does not
        grow with the rest of the graph.
        """
        self._check_soon = False
        scheduler = self.scheduler
        if scheduler is None or not scheduler.unrunnable:
            return
        if not self._active():
            return  # unregistered or replaced; its timers may still fire
        now = monotonic()
        stimulus_id = f"accelsched-fallback-{time()}"
        largest = max(scheduler.resources.get(GPU, {}).values(), default=0)
        recs: dict[Any, Any] = {}
        next_deadline = float("inf")
        for ts, since in list(scheduler.unrunnable.items()):
            key = ts.key
            if key in self.invalid:
                self._err(ts, self.invalid[key], stimulus_id)  # kept: a retry errs again
                continue
            amount = (ts.resource_restrictions or {}).get(GPU)
            if not amount:
                continue
            timeout = self._timeout_of(key)
            reason = self.policy.decide(
                waited=now - since,
                timeout=timeout,
                predecessor_fell_back=any(d.key in self.fell_back for d in ts.dependencies),
                gpu_capacity=largest >= amount,
            )
            if reason is None:
                if timeout is not None:
                    next_deadline = min(next_deadline, since + timeout)
                continue
            self._fall_back(ts, reason, now - since)
            recs[key] = "processing"
        if recs:
            scheduler.transitions(recs, stimulus_id=stimulus_id)
        self._wake_at(next_deadline)

    def _wake_at(self, deadline: float) -> None:
        """Check again exactly when the next timeout expires, not at the next tick.

        The periodic check stays as a safety net; this keeps fallback latency close to
        the timeout instead of up to one ``fallback_interval`` past it.
        """
        scheduler = self.scheduler
        if scheduler is None or deadline == float("inf"):
            return
        if self._timer is not None:
            if self._timer[0] <= deadline:
                return
            scheduler.loop.remove_timeout(self._timer[1])
        delay = max(0.0, deadline - monotonic()) + 0.001

        def fire() -> None:
            self._timer = None
            self.check_fallback()

        self._timer = (deadline, scheduler.loop.call_later(delay, fire))

    def _timeout_of(self, key: Any) -> float | None:
        """The task's annotated timeout, else the plugin default (the policy's rule)."""
        return (
            self.policy.timeout(self.timeouts[key])
            if key in self.timeouts
            else self.policy.timeout()
        )

    def _fall_back(self, ts: Any, reason: str, waited: float) -> None:
        restrictions = dict(ts.resource_restrictions)
        restrictions.pop(GPU, None)
        ts.resource_restrictions = restrictions
        ts.annotations = {**(ts.annotations or {}), FALLBACK_ANNOTATION: reason}
        self.fell_back.add(ts.key)
        self._emit(events.FALLBACK, None, key=ts.key, waited=round(waited, 3), reason=reason)

    def _err(self, ts: Any, message: str, stimulus_id: str) -> None:
        assert self.scheduler is not None
        recs = self.scheduler.transition(
            ts.key,
            "erred",
            exception=pickle.dumps(ValueError(f"task {ts.key!r}: {message}")),
            cause=ts.key,
            stimulus_id=stimulus_id,
        )
        self.scheduler.transitions(recs, stimulus_id=stimulus_id)

    def _warn_no_workers_timeout(self, timeout: float | None) -> None:
        """Warn (once) when distributed would fail tasks before they could fall back."""
        if timeout is None or getattr(self, "_warned_no_workers", False):
            return
        limit = dask.config.get("distributed.scheduler.no-workers-timeout", None)
        if limit is None:
            return
        limit_s = dask.utils.parse_timedelta(limit)
        if limit_s is not None and limit_s < timeout:
            self._warned_no_workers = True
            msg = (
                f"distributed.scheduler.no-workers-timeout ({limit_s}s) is shorter than "
                f"accelsched's fallback timeout ({timeout}s): the scheduler will fail "
                "unplaceable GPU tasks with NoValidWorkerError before they can fall back"
            )
            logger.warning(msg)
            warnings.warn(msg, RuntimeWarning, stacklevel=2)

    # --- the gate -----------------------------------------------------------------------

    def _handle_inventory(
        self,
        worker: str,
        devices: list[dict[str, Any]],
        declared: float | None = None,
        requested: int = 0,
        reason: str | None = None,
    ) -> dict[str, Any]:
        """A GuardPlugin reports the devices it verified and the count it wants.

        Returns the devices granted (a subset when another worker owns some) and a token
        the worker presents on later requests. Idempotent: a repeated, unchanged report
        changes nothing and logs nothing.
        """
        assert self.scheduler is not None
        if not self._active():
            return {"status": "no-plugin"}
        ws = self.scheduler.workers.get(worker)
        if ws is None:
            return {"status": "unknown-worker"}
        wanted = devices[:requested]
        previous = self.inventory.get(worker)
        if (
            previous is not None
            and [d["uuid"] for d in previous] == [d["uuid"] for d in wanted]
            and not self.refused.get(worker)
        ):
            return self._grant_reply(worker)
        granted_uuids, refused = self.registry.claim(worker, [d["uuid"] for d in wanted])
        granted = [d for d in wanted if d["uuid"] in granted_uuids]
        self.inventory[worker] = granted
        self.refused[worker] = set(refused)
        self.granted[worker] = len(granted)
        self.tokens.setdefault(worker, secrets.token_hex(16))
        if granted:
            self._emit(events.GPU_VERIFIED, worker, devices=granted, granted=len(granted))
        if refused:
            owners = sorted(set(refused.values()))
            self._emit(
                events.GPU_REJECTED,
                worker,
                uuids=sorted(refused),
                reason="owned",
                owner=owners[0] if len(owners) == 1 else owners,
            )
        if declared != len(granted) and (reason is not None or refused):
            self._emit(
                events.GPU_CORRECTED,
                worker,
                declared=declared,
                granted=len(granted),
                reason="owned" if refused else reason,
            )
        return self._grant_reply(worker)

    def _grant_reply(self, worker: str) -> dict[str, Any]:
        return {
            "status": "OK",
            "uuids": [d["uuid"] for d in self.inventory.get(worker, [])],
            "token": self.tokens.get(worker),
        }

    def allowed_gpus(self, worker: str) -> int:
        """The most GPUs ``worker`` may advertise now (0 while quarantined)."""
        if worker in self.quarantined:
            return 0
        return self.granted.get(worker, 0)

    def _gated_set_resources(self, original: Any, worker: str, resources: dict | None) -> str:
        """distributed's ``set_resources`` handler, with GPU clamped to the grant."""
        assert self.scheduler is not None
        ws = self.scheduler.workers.get(worker)
        if ws is None:
            return original(worker=worker, resources=resources)
        resources = dict(resources or {})
        before = ws.resources.get(GPU, 0)
        if GPU in resources or GPU in ws.resources:
            resources[GPU] = min(resources.get(GPU, 0), self.allowed_gpus(worker))
        used = dict(ws.used_resources)
        result = original(worker=worker, resources=resources)
        # add_resources zeroes used_resources; tasks already processing still use them.
        for r, quantity in used.items():
            if r in ws.used_resources:
                ws.used_resources[r] = quantity
        if resources.get(GPU, 0) > before:
            self.reoffer(ws)
        return result

    def _set_gpu(self, ws: WorkerState, value: float) -> None:
        """Set a worker's GPU resource on the scheduler, keeping what tasks use."""
        assert self.scheduler is not None or ws is not None
        ws.resources[GPU] = value
        ws.used_resources.setdefault(GPU, 0)
        scheduler = self.scheduler
        if scheduler is not None:
            scheduler.resources.setdefault(GPU, {})[ws.address] = value

    def reoffer(self, ws: WorkerState) -> None:
        """Offer ``no-worker`` tasks to ``ws`` (its GPUs just became valid)."""
        assert self.scheduler is not None
        recs = self.scheduler.bulk_schedule_unrunnable_after_adding_worker(ws)
        if recs:
            self.scheduler.transitions(recs, stimulus_id=f"accelsched-gpu-verified-{time()}")

    # --- restarts -----------------------------------------------------------------------

    def _handle_restart(
        self, comm: Any, worker: str, token: str | None = None, reason: str = "leak", **figures: Any
    ) -> dict[str, Any]:
        """A worker asks to be restarted. Only the worker itself may ask.

        The request must carry the secret token the scheduler handed this worker, over
        the worker's own connection, when its GPUs were verified. (The connection's
        address is no proof either way: a multi-homed worker or one behind NAT connects
        from another address than it advertises.) The restart itself runs in the
        background; the reply says whether it was accepted.
        """
        assert self.scheduler is not None
        if not self._active():
            return {"status": "no-plugin"}
        ws = self.scheduler.workers.get(worker)
        expected = self.tokens.get(worker)
        peer = getattr(comm, "peer_address", None)
        if ws is None or expected is None or not secrets.compare_digest(str(token), expected):
            logger.warning(
                "accelsched: refused a restart request for %s from %s: not that worker",
                worker,
                peer,
            )
            return {"status": "refused"}
        if ws.nanny is None:
            self._defer(worker, "no-nanny")
            return {"status": "deferred", "reason": "no-nanny"}
        if not any(w is not ws for w in self.scheduler.running):
            self._defer(worker, "no-peer")
            return {"status": "deferred", "reason": "no-peer"}
        decision = self.budget.request(ws.nanny, monotonic())
        if decision.reason == "in-flight":
            return {"status": "in-flight"}  # its restart is under way: nothing to do
        if not decision.allowed:
            if decision.reason == "budget":
                self._quarantine(worker, "restart-budget")
            else:
                self._defer(worker, decision.reason or "concurrency")
            return {"status": "deferred", "reason": decision.reason}
        self.scheduler._ongoing_background_tasks.call_soon(self._restart, worker, ws.nanny, reason)
        return {"status": "accepted"}

    async def _restart(self, worker: str, budget_key: str, reason: str) -> None:
        """Drain, retire, check, restart: the only order that loses nothing."""
        scheduler = self.scheduler
        assert scheduler is not None
        stimulus_id = f"accelsched-restart-{time()}"
        start = monotonic()
        restarted = False
        ws = scheduler.workers.get(worker)
        try:
            if ws is None:
                return
            # No new tasks for this worker (scheduler side only: the worker itself keeps
            # running what it was given, so its executing tasks finish).
            scheduler.handle_worker_status_change(Status.closing_gracefully, ws, stimulus_id)
            deadline = monotonic() + DRAIN_TIMEOUT
            while ws.processing and monotonic() < deadline:
                await asyncio.sleep(0.05)
            if ws.processing:
                self._give_up(ws, "busy", stimulus_id)
                return
            # Retire and kill one worker at a time: while a retired worker is still
            # registered, another retirement could drop the only other copy of its keys
            # ("the retired worker still has it") just before it is killed.
            async with self._retire_lock:
                if worker not in scheduler.workers:
                    return
                moved = len(ws.has_what)
                retired = await scheduler.retire_workers(
                    workers=[worker], close_workers=False, remove=False, stimulus_id=stimulus_id
                )
                if worker not in retired:
                    self._give_up(ws, "no-peer", stimulus_id)
                    return
                if any(len(ts.who_has or ()) < 2 for ts in ws.has_what):
                    self._give_up(ws, "retire-failed", stimulus_id)
                    return
                result = await scheduler.restart_workers(
                    [worker], wait_for_workers=False, on_error="return", stimulus_id=stimulus_id
                )
                restarted = result.get(worker) == "OK"
                if not restarted:
                    self._give_up(ws, f"restart-failed: {result.get(worker)}", stimulus_id)
                    return
                deadline = monotonic() + 30
                while worker in scheduler.workers and monotonic() < deadline:
                    await asyncio.sleep(0.01)  # gone from who_has before the next retire
            self._emit(
                events.RESTART,
                worker,
                reason=reason,
                moved=moved,
                seconds=round(monotonic() - start, 3),
            )
        except Exception as exc:
            logger.exception("accelsched: restart of %s failed", worker)
            if ws is not None:
                self._give_up(ws, f"restart-failed: {exc!r}", stimulus_id)
        finally:
            self.budget.done(budget_key, counted=restarted)

    def _give_up(self, ws: WorkerState, reason: str, stimulus_id: str) -> None:
        """Quarantine first, then take the worker back into service.

        In this order the GPU tasks that piled up during the drain are not offered to the
        worker that leaks: they wait for (or fall back from) other GPUs.
        """
        self._defer(ws.address, reason)
        self._resume(ws, stimulus_id)

    def _resume(self, ws: WorkerState, stimulus_id: str) -> None:
        """Undo a drain: the worker takes tasks again (its GPUs stay quarantined)."""
        assert self.scheduler is not None
        if ws.address not in self.scheduler.workers:
            return
        self.scheduler.stream_comms[ws.address].send(
            {"op": "worker-status-change", "status": "running", "stimulus_id": stimulus_id}
        )
        self.scheduler.handle_worker_status_change(Status.running, ws, stimulus_id)

    def _defer(self, worker: str, reason: str) -> None:
        """The restart cannot happen without loss now: quarantine, and say so once."""
        if self.scheduler is None or worker not in self.scheduler.workers:
            return  # it left meanwhile: nothing to defer
        if self.deferred.get(worker) != reason:
            self.deferred[worker] = reason
            self._emit(events.RESTART_DEFERRED, worker, reason=reason)
        self._quarantine(worker, f"restart-deferred: {reason}")

    def _quarantine(self, worker: str, reason: str) -> None:
        """Take the worker's GPUs out of placement; GPU tasks go elsewhere or fall back."""
        assert self.scheduler is not None
        ws = self.scheduler.workers.get(worker)
        if ws is None or worker in self.quarantined:
            return
        self.quarantined[worker] = reason
        self._set_gpu(ws, 0)
        self._emit(events.QUARANTINE, worker, reason=reason)

    # --- events -------------------------------------------------------------------------

    def log_event(self, topic: str, msg: Any) -> None:
        """Every event the scheduler logs: feed accelsched's own to the metrics.

        Worker-side events (``leak``, ``unrequested-gpu-use``, ...) arrive here too.
        """
        if topic == events.TOPIC and isinstance(msg, dict):
            metrics.observe(msg)
            if msg.get("action") in (events.GPU_VERIFIED, events.QUARANTINE):
                self._update_gpu_gauge()

    def _update_gpu_gauge(self) -> None:
        quarantined = sum(self.granted.get(w, 0) for w in self.quarantined)
        metrics.set_gpus(sum(self.granted.values()) - quarantined, quarantined)

    def _emit(self, action: str, worker: str | None = None, **figures: Any) -> None:
        assert self.scheduler is not None
        msg = events.event(action, worker, **figures)
        logger.info("accelsched %s", msg)
        self.scheduler.log_event(events.TOPIC, msg)
