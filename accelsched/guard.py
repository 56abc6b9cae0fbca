"""GuardPlugin: the worker side of accelsched.

- **Inventory.** Probe the devices through NVML, decide which this worker owns, report
  them to the PlacementPlugin and set the worker's ``GPU`` resource to what was granted.
- **Binding.** Give each running GPU task its own device, current in its thread.
- **Unrequested use.** Notice a task that did not ask for a GPU but created a CUDA
  context or grew this process's device memory.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import TYPE_CHECKING, Any

from distributed.diagnostics.plugin import WorkerPlugin

from accelsched import events
from accelsched.binding import LeaseTable, wrap_task
from accelsched.config import GUARD_OPTIONS, resolve_options
from accelsched.context import Lease, holding
from accelsched.devices.nvml import DeviceInfo, MemoryReading, NVMLMonitor
from accelsched.inventory import Grant, decide_count, owned
from accelsched.placement import GPU, INVENTORY_HANDLER

if TYPE_CHECKING:
    from dask._task_spec import GraphNode
    from distributed import Worker

__all__ = ["GuardPlugin", "UnrequestedGPUUse"]

logger = logging.getLogger(__name__)

REPORT_HANDLER = "accelsched_report"
_DECLARED_ATTR = "_accelsched_declared"


class UnrequestedGPUUse(RuntimeError):
    """A task that did not ask for a GPU used one (``unrequested_gpu="fail"``)."""


class _GPUActivity:
    """GPU tasks running in this process, across all its workers.

    Device memory is read per process, so a CPU task's growth can be blamed on it only
    when no GPU task of any worker in the process ran meanwhile.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running = 0
        self.generation = 0

    def enter(self) -> None:
        with self.lock:
            self.running += 1
            self.generation += 1

    def exit(self) -> None:
        with self.lock:
            self.running -= 1
            self.generation += 1

    def quiet(self) -> tuple[bool, int]:
        with self.lock:
            return self.running == 0, self.generation


_ACTIVITY = _GPUActivity()


class GuardPlugin(WorkerPlugin):
    """Verified inventory, per-task device binding, unrequested-use detection.

    Options (each also dask config under ``accelsched.guard.``, see
    ``docs/configuration.md``) are validated here, on the client.
    """

    name = "accelsched-guard"

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

    async def teardown(self, worker: Worker) -> None:
        if worker.handlers.get(REPORT_HANDLER) == self.report:
            del worker.handlers[REPORT_HANDLER]

    def transition(self, key: Any, start: str, finish: str, **kwargs: Any) -> None:
        """Wrap a task's run spec as it starts executing (on the worker's event loop).

        GPU tasks get a device lease; other tasks are watched for GPU use when devices
        are visible. The wrapping itself is O(1); the work happens in the task's thread.
        """
        if finish != "executing" or self.worker is None:
            return
        ts = self.worker.state.tasks.get(key)
        if ts is None or ts.run_spec is None or ts.run_spec.is_coro:
            return
        amount = (ts.resource_restrictions or {}).get(GPU, 0)
        if amount > 0 and self.devices:
            ts.run_spec = wrap_task(ts.run_spec, self._gpu_runner(key, amount))
        elif self.visible and self.options["unrequested_gpu"] != "ignore":
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
            _ACTIVITY.enter()
            try:
                with holding(Lease(key, devices, simulated=self.simulated)):
                    return spec(values)
            finally:
                _ACTIVITY.exit()
                self.leases.release(key)

        return run

    def _watch_runner(self, key: Any):  # type: ignore[no-untyped-def]
        def run(spec: GraphNode, values: dict) -> Any:
            quiet, generation = _ACTIVITY.quiet()
            before = self._readings() if quiet else None
            result = spec(values)
            if before is not None and _ACTIVITY.quiet() == (True, generation):
                self._check_unrequested(key, before, self._readings())
            return result

        return run

    def _readings(self) -> dict[int, MemoryReading]:
        assert self.monitor is not None
        return {d.index: self.monitor.process_memory(d.index) for d in self.visible}

    def _check_unrequested(
        self, key: Any, before: dict[int, MemoryReading], after: dict[int, MemoryReading]
    ) -> None:
        for device, now in after.items():
            then = before[device]
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

    # --- events -------------------------------------------------------------------------

    def _emit(self, action: str, **figures: Any) -> None:
        """Send an event to the scheduler's log; safe from any thread."""
        worker = self.worker
        assert worker is not None
        msg = events.event(action, worker.contact_address, **figures)
        logger.info("accelsched %s", msg)
        worker.loop.add_callback(worker.log_event, events.TOPIC, msg)


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
