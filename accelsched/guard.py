"""GuardPlugin: the worker side of accelsched.

- **Inventory.** Probe the devices through NVML, decide which this worker owns, report
  them to the PlacementPlugin and set the worker's ``GPU`` resource to what was granted.
- **Binding.** Give each running GPU task its own device, current in its thread.
- **Unrequested use.** Notice a task that did not ask for a GPU but created a CUDA
  context or grew this process's device memory.
- **Pools.** Free CuPy's (and the simulated) memory pools after GPU tasks.
- **Leaks.** Every ``check_interval``, estimate device memory nothing legitimate holds
  (:mod:`accelsched.leak`); on a confirmed leak, ask the scheduler to restart this worker
  without losing data. Only the worker itself can ask: the request carries the token the
  scheduler handed it at verification.
"""

from __future__ import annotations

import itertools
import logging
import os
import sys
import threading
from typing import TYPE_CHECKING, Any

from dask.utils import key_split
from distributed.diagnostics.plugin import WorkerPlugin
from tornado.ioloop import PeriodicCallback

from accelsched import events
from accelsched.binding import LeaseTable, wrap_task
from accelsched.config import GUARD_OPTIONS, resolve_options
from accelsched.context import Lease, holding, using_device
from accelsched.devices.arrays import device_nbytes, to_host
from accelsched.devices.nvml import DeviceInfo, MemoryReading, NVMLMonitor
from accelsched.devices.pool import PoolStats, active_pools
from accelsched.inventory import Grant, decide_count, owned
from accelsched.leak import Baseline, LeakDetector, Verdict, estimate
from accelsched.placement import (
    FALLBACK_ANNOTATION,
    GPU,
    GUARD_NAME,
    INVENTORY_HANDLER,
    RESTART_HANDLER,
)

if TYPE_CHECKING:
    from dask._task_spec import GraphNode
    from distributed import Worker

__all__ = ["GuardPlugin", "UnrequestedGPUUse"]

logger = logging.getLogger(__name__)

REPORT_HANDLER = "accelsched_report"
_CALLBACK = "accelsched-guard"
_DECLARED_ATTR = "_accelsched_declared"


class UnrequestedGPUUse(RuntimeError):
    """A task that did not ask for a GPU used one (``unrequested_gpu="fail"``)."""


class _Activity:
    """Wrapped tasks (GPU or watched) running in this process, across all its workers.

    Device memory is read per process, so a task's growth can be blamed on it only when
    it ran alone: no other wrapped task started or ended while it ran.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running = 0
        self.generation = 0

    def enter(self) -> int | None:
        """Count a task in; return a token when it is alone, else None."""
        with self.lock:
            alone = self.running == 0
            self.running += 1
            self.generation += 1
            return self.generation if alone else None

    def still_alone(self, token: int | None) -> bool:
        with self.lock:
            return token is not None and self.generation == token

    def exit(self) -> None:
        with self.lock:
            self.running -= 1
            self.generation += 1


_ACTIVITY = _Activity()


class GuardPlugin(WorkerPlugin):
    """Verified inventory, per-task device binding, unrequested-use detection.

    Options (each also dask config under ``accelsched.guard.``, see
    ``docs/configuration.md``) are validated here, on the client.
    """

    name = GUARD_NAME

    def __init__(self, **options: Any) -> None:
        self.options = resolve_options(GUARD_OPTIONS, options, type(self).__name__)
        self._init_state()

    def _init_state(self) -> None:
        self.worker: Worker | None = None
        self.monitor: NVMLMonitor | None = None
        self.visible: list[DeviceInfo] = []
        self.owned: list[DeviceInfo] = []
        self.devices: list[DeviceInfo] = []  # granted by the scheduler
        self.grant = Grant(0, None)
        self.declared: float | None = None
        self.token: str | None = None
        self.simulated = False
        self.leases = LeaseTable()
        self.live: dict[Any, dict[int, int]] = {}  # key -> device bytes it holds
        self.live_total: dict[int, int] = {}  # device -> bytes of live results
        self.baselines: dict[int, Baseline] = {}
        self.detector = LeakDetector(self.options["leak_confirmations"])
        self._gpu_task_count = itertools.count(1)  # next() is atomic across threads
        self.restart_pending = False
        self.reported_leaks: dict[int, int] = {}  # device -> bytes already reported
        self.used_devices: set[int] = set()  # devices GPU tasks of this worker held
        self.last_verdicts: list[Verdict] = []

    def __getstate__(self) -> dict[str, Any]:
        return {"options": self.options}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.options = state["options"]
        self._init_state()

    # --- WorkerPlugin hooks -------------------------------------------------------------

    async def setup(self, worker: Worker) -> None:
        """Probe devices, report them, and advertise only what the scheduler granted.

        Worker plugins run after the worker registered, so its declared ``GPU`` count is
        already known to the scheduler; the PlacementPlugin ignores it until this report.
        """
        self.worker = worker
        if not hasattr(worker, _DECLARED_ATTR):
            setattr(worker, _DECLARED_ATTR, worker.state.total_resources.get(GPU))
        self.declared = getattr(worker, _DECLARED_ATTR)
        self.monitor = NVMLMonitor()
        self.simulated = bool(os.environ.get("ACCELSCHED_FAKE_NVML_DIR"))
        self.visible = self.monitor.devices()
        self.owned = owned(self.visible, under_dask_cuda=_under_dask_cuda(worker))
        self.grant = decide_count(
            self.declared,
            len(self.owned),
            advertise_undeclared=self.options["advertise_undeclared"],
        )
        worker.handlers[REPORT_HANDLER] = self.report
        await self.report()
        old = worker.periodic_callbacks.pop(_CALLBACK, None)
        if old is not None:
            old.stop()
        if self.visible:
            pc = PeriodicCallback(self._periodic_check, self.options["check_interval"] * 1000)
            worker.periodic_callbacks[_CALLBACK] = pc
            pc.start()

    async def teardown(self, worker: Worker) -> None:
        if worker.handlers.get(REPORT_HANDLER) == self.report:
            del worker.handlers[REPORT_HANDLER]
        pc = worker.periodic_callbacks.pop(_CALLBACK, None)
        if pc is not None:
            pc.stop()

    def transition(self, key: Any, start: str, finish: str, **kwargs: Any) -> None:
        """Wrap a task's run spec as it starts executing (on the worker's event loop).

        GPU tasks get a device lease; other tasks are watched for GPU use when devices
        are visible. The wrapping itself is O(1); the work happens in the task's thread.
        """
        if self.worker is None or not self.visible:
            return
        if finish == "memory":
            self._track_live(key)
        elif start == "memory":
            self._untrack_live(key)
        if finish != "executing":
            return
        self.detector.ran(key_split(key))
        ts = self.worker.state.tasks.get(key)
        if ts is None or ts.run_spec is None or ts.run_spec.is_coro:
            return
        executor = self.worker.executors.get((ts.annotations or {}).get("executor", "default"))
        if "ThreadPoolExecutor" not in str(type(executor)):
            return  # another process runs it (distributed's own test): nothing to bind
        amount = (ts.resource_restrictions or {}).get(GPU, 0)
        if amount > 0 and self.devices:
            ts.run_spec = wrap_task(ts.run_spec, self._gpu_runner(key, amount))
        elif (ts.annotations or {}).get(FALLBACK_ANNOTATION):
            ts.run_spec = wrap_task(ts.run_spec, self._fallback_runner(key))
        elif self.options["unrequested_gpu"] != "ignore":
            ts.run_spec = wrap_task(ts.run_spec, self._watch_runner(key))

    # --- inventory ----------------------------------------------------------------------

    async def report(self) -> dict[str, Any]:
        """Report the owned devices to the scheduler and advertise what it granted."""
        worker = self.worker
        assert worker is not None
        try:
            reply = await worker.scheduler.accelsched_inventory(
                worker=worker.contact_address,
                devices=[d.as_dict() for d in self.owned],
                declared=self.declared,
                requested=self.grant.count,
                reason=self.grant.reason,
            )
        except Exception as exc:
            logger.info("accelsched: GPU report to the scheduler failed: %r", exc)
            reply = None
        if isinstance(reply, dict) and reply.get("status") == "OK":
            granted = set(reply["uuids"])
            self.token = reply.get("token")
        elif reply is None:
            # No PlacementPlugin: nothing enforces placement, but the worker still
            # advertises only what it owns.
            logger.warning(
                "accelsched: no PlacementPlugin on the scheduler (handler %r missing); "
                "correcting this worker's GPU count without verification",
                INVENTORY_HANDLER,
            )
            granted = {d.uuid for d in self.owned[: self.grant.count]}
        else:
            return reply if isinstance(reply, dict) else {"status": repr(reply)}
        self.devices = [d for d in self.owned if d.uuid in granted]
        self.leases.set_devices([d.index for d in self.devices])
        if self.devices or GPU in worker.state.total_resources:
            await worker.set_resources(**{GPU: len(self.devices)})
        return {"status": "OK", "devices": [d.index for d in self.devices]}

    # --- per-task runners (called in the executor thread) -------------------------------

    def _gpu_runner(self, key: Any, amount: float):  # type: ignore[no-untyped-def]
        def run(spec: GraphNode, values: dict) -> Any:
            devices = self.leases.acquire(key, amount)
            self.used_devices.update(devices)
            _ACTIVITY.enter()
            try:
                with holding(
                    Lease(
                        key,
                        devices,
                        simulated=self.simulated,
                        report=self._emit,
                        oom_exceptions=self.options["oom_exceptions"],
                    )
                ):
                    try:
                        return spec(values)
                    finally:
                        self._after_gpu_task(devices)
            finally:
                _ACTIVITY.exit()
                self.leases.release(key)

        return run

    def _fallback_runner(self, key: Any):  # type: ignore[no-untyped-def]
        """A fallen-back task: its device-array inputs are copied to the host first.

        Only possible on a worker that could receive them, one with CuPy and a GPU;
        elsewhere such inputs cannot even be deserialized (see docs/fallback.md).
        """
        watching = self.options["unrequested_gpu"] != "ignore"
        inner = self._watch_runner(key) if watching else (lambda spec, values: spec(values))

        def run(spec: GraphNode, values: dict) -> Any:
            return inner(spec, {k: to_host(v) for k, v in values.items()})

        return run

    def _watch_runner(self, key: Any):  # type: ignore[no-untyped-def]
        def run(spec: GraphNode, values: dict) -> Any:
            token = _ACTIVITY.enter()
            try:
                before = self._readings() if token is not None else None
                result = spec(values)
                if before is not None and _ACTIVITY.still_alone(token):
                    self._check_unrequested(key, before, self._readings())
                return result
            finally:
                _ACTIVITY.exit()

        return run

    def _readings(self) -> dict[int, MemoryReading]:
        assert self.monitor is not None
        return {d.index: self.monitor.process_memory(d.index) for d in self.visible}

    def _check_unrequested(
        self, key: Any, before: dict[int, MemoryReading], after: dict[int, MemoryReading]
    ) -> None:
        for device, now in after.items():
            then = before[device]
            if not (now.exact and then.exact):
                continue  # not this process's own figure: another process may have grown
            grew = now.nbytes - then.nbytes
            created = bool(now.has_context) and then.has_context is False
            if grew <= 0 and not created:
                continue
            fail = self.options["unrequested_gpu"] == "fail"
            self._emit(
                events.UNREQUESTED_GPU_USE,
                key=key,
                device=device,
                nbytes=max(grew, 0),
                context_created=created,
                failed=fail,
            )
            if fail:
                raise UnrequestedGPUUse(
                    f"task {key!r} did not ask for a GPU but used device {device} "
                    f"({'created a CUDA context, ' if created else ''}"
                    f"device memory grew by {max(grew, 0)} bytes); annotate it with "
                    f"dask.annotate(resources={{'GPU': 1}})"
                )

    # --- pools and leaks ----------------------------------------------------------------

    def _after_gpu_task(self, devices: tuple[int, ...]) -> None:
        """Free the pools every ``free_pools_every`` GPU tasks (in the task's thread)."""
        every = self.options["free_pools_every"]
        if not every or next(self._gpu_task_count) % every:
            return
        above = self.options["free_pools_above"]
        if above > 0:
            assert self.monitor is not None
            fractions = [self.monitor.used(d) / self.monitor.device(d).memory for d in devices]
            if max(fractions, default=0) <= above:
                return
        pools = active_pools()
        # CuPy frees the current device's pool: visit each device the task held
        for device in devices:
            with using_device(device, simulated=self.simulated):
                for pool in pools:
                    pool.free_all()

    def _track_live(self, key: Any) -> None:
        worker = self.worker
        assert worker is not None
        data = worker.data
        fast = getattr(data, "fast", data)
        try:
            value = fast.get(key)
        except Exception:  # a value that cannot be read back is not counted
            value = None
        held = device_nbytes(value) if value is not None else {}
        if held:
            self.live[key] = held
            for d, n in held.items():
                self.live_total[d] = self.live_total.get(d, 0) + n

    def _untrack_live(self, key: Any) -> None:
        for d, n in self.live.pop(key, {}).items():
            self.live_total[d] = self.live_total.get(d, 0) - n

    def _periodic_check(self) -> None:
        self.check()

    def check(self) -> list[Verdict]:
        """One leak check over this process's devices (periodic, on the event loop).

        Devices with a GPU task running are skipped: a task's temporaries are neither
        results nor leaks, and the estimate means nothing until it ends.
        """
        assert self.monitor is not None
        busy = {d for devices in self.leases.holders().values() for d in devices}
        pools = active_pools()
        verdicts: list[Verdict] = []
        for dev in self.owned:
            if dev.index in busy:
                continue
            try:
                reading = self.monitor.process_memory(dev.index)
            except Exception as exc:  # NVMLError: the device stopped answering
                self._unhealthy(dev, exc)
                continue
            if dev.index not in self.used_devices:
                continue  # no GPU task of this worker held it: nothing of ours to judge
            if reading.has_context is False or not reading.attributable:
                continue
            pool = sum((p.stats(dev.index) for p in pools), PoolStats())
            live = self.live_total.get(dev.index, 0)
            base = self.baselines.setdefault(dev.index, Baseline())
            baseline = base.observe(reading.nbytes, live, pool.held)
            leaked = estimate(reading.nbytes, baseline, live, pool)
            threshold = self.options["leak_threshold"].resolve(dev.memory)
            verdicts.append(self.detector.check(dev.index, leaked, threshold))
        blamed = self.detector.end_check(verdicts, complete=not busy)
        self.last_verdicts = verdicts
        leaks = [v for v in verdicts if v.leak]
        if leaks:
            for v in leaks:
                # While a restart is deferred the leak is confirmed again and again; say
                # so once, and again only if it grew by another threshold's worth.
                if v.estimate - self.reported_leaks.get(v.device, -v.threshold) < v.threshold:
                    continue
                self.reported_leaks[v.device] = v.estimate
                self._emit(
                    events.LEAK,
                    device=v.device,
                    nbytes=v.estimate,
                    threshold=v.threshold,
                    checks=v.above,
                    prefixes=blamed,
                )
            self.detector.reset()
            if self.options["restart_on_leak"] and not self.restart_pending:
                assert self.worker is not None
                self.restart_pending = True
                self.worker.loop.add_callback(
                    self._request_restart, "leak", sum(v.estimate for v in leaks)
                )
        return verdicts

    def _unhealthy(self, dev: DeviceInfo, exc: BaseException) -> None:
        """A verified device stopped answering NVML: restart the worker without it.

        Lowering the worker's GPU count in place would strand tasks distributed already
        assigned against the old count; a lossless restart re-probes the devices and the
        new process reports only those that answer. Until then no new lease lands on it.
        """
        if dev not in self.devices:
            return
        remaining = [d.index for d in self.devices if d != dev]
        if remaining:
            self.leases.set_devices(remaining)
        self._emit(events.GPU_UNHEALTHY, device=dev.index, uuid=dev.uuid, error=repr(exc))
        if not self.restart_pending:
            assert self.worker is not None
            self.restart_pending = True
            self.worker.loop.add_callback(self._request_restart, "gpu-unhealthy", 0)

    async def _request_restart(self, reason: str, nbytes: int) -> None:
        worker = self.worker
        assert worker is not None
        try:
            reply = await worker.scheduler.accelsched_restart(
                worker=worker.contact_address, token=self.token, reason=reason, nbytes=nbytes
            )
            logger.info("accelsched: restart request answered %r", reply)
        except Exception as exc:
            logger.warning("accelsched: restart request (%s) failed: %r", RESTART_HANDLER, exc)
        finally:
            self.restart_pending = False

    # --- events -------------------------------------------------------------------------

    def _emit(self, action: str, **figures: Any) -> None:
        """Send an event to the scheduler's log (``Worker.log_event`` is thread-safe)."""
        worker = self.worker
        assert worker is not None
        msg = events.event(action, worker.contact_address, **figures)
        logger.info("accelsched %s", msg)
        worker.log_event(events.TOPIC, msg)


def _under_dask_cuda(worker: Worker) -> bool:
    """True for workers started by dask-cuda (LocalCUDACluster, ``dask cuda worker``).

    dask-cuda gives its workers plugins of its own (CPU affinity, RMM setup, ...), and
    only then is ``dask_cuda`` imported in the worker process.
    """
    if "dask_cuda" not in sys.modules:
        return False
    return any(
        type(p).__module__.startswith("dask_cuda") for p in getattr(worker, "plugins", {}).values()
    )
