"""Each worker's ``GPU`` count in distributed's placement: what :class:`Grants` allows.

A declared ``GPU`` resource is live in distributed before anything has checked it, and
anyone can call ``set_resources`` naming any worker. So the count is stripped at
registration, set within the grant whenever the worker's guard offers (or anyone calls
``set_resources``), zero while the worker is quarantined, and back to the declaration when
the plugin is unregistered. A worker whose count grows is offered the ``no-worker`` tasks
(distributed does not); one whose count shrinks sends back what no longer fits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from accelsched import internals
from accelsched.observe import metrics
from accelsched.policy.requirements import capacity, mebibytes
from accelsched.protocol import GPU, GPU_MEMORY, DeviceRecord
from accelsched.scheduler.grants import Grants

if TYPE_CHECKING:
    from distributed import Scheduler
    from distributed.scheduler import WorkerState

__all__ = ["GpuCounts", "memory_capacity"]


def memory_capacity(records: list[DeviceRecord], count: int) -> int:
    """``GPU-memory`` (MiB) a worker offers: its first ``count`` granted devices'
    capacity (fewer while one is withdrawn: which one the offer does not say)."""
    return sum(mebibytes(capacity(int(d["memory"]))) for d in records[:count])


class GpuCounts:
    """Sets the GPU count of every worker from its grant; serves the GPU gauge."""

    def __init__(
        self,
        scheduler: Scheduler,
        grants: Grants,
        *,
        active: Callable[[], bool],
        gained: Callable[[str], None],
    ) -> None:
        """Gate ``set_resources``, serve the gauge, strip every worker's declared GPUs.

        ``gained(worker)``: the worker's devices were granted (tasks with requirements
        it meets gain it)."""
        self.scheduler = scheduler
        self._grants = grants
        self._active = active
        self._gained = gained
        internals.wrap_set_resources(scheduler, self.set_resources)
        metrics.gpus_from(self._grants.gauge)
        for ws in list(scheduler.workers.values()):
            self.add_worker(ws)

    def stop(self) -> None:
        """Unregistered: distributed's ``set_resources``, and every worker's GPU count as
        it was declared."""
        internals.restore_set_resources(self.scheduler)
        self.close()
        for addr, count in self._grants.take_declarations().items():
            ws = self.scheduler.workers.get(addr)
            if ws is not None:
                internals.set_worker_gpus(self.scheduler, ws, count)

    def close(self) -> None:
        """The gauge no longer reads these grants."""
        metrics.stop_gpus(self._grants.gauge)

    def add_worker(self, ws: WorkerState) -> None:
        """The declared count does not count: nothing reaches the worker on its word.

        A worker that declared no GPU stays out of the ``GPU`` resource altogether (a
        ``GPU: 0`` entry would make it valid for ``resources={"GPU": 0}`` tasks, which its
        own state machine cannot run).
        """
        if GPU not in ws.resources:
            return
        self._grants.declare(ws.address, ws.resources[GPU])
        internals.set_worker_gpus(self.scheduler, ws, self._grants.allowed(ws.address))

    def place(self, ws: WorkerState) -> None:
        """Set the worker's GPU count to what its grant places; offer or send back tasks."""
        scheduler = self.scheduler
        if not (after := self._grants.placed(ws.address)) and GPU not in ws.resources:
            return  # never declared, nothing granted: stays out of the GPU resource
        before = ws.resources.get(GPU, 0)
        internals.set_worker_gpus(scheduler, ws, after)
        # declared-memory tasks take GPU-memory: the granted devices' capacity
        records = self._grants.granted_devices().get(ws.address, [])
        internals.set_worker_gpus(scheduler, ws, memory_capacity(records, after), GPU_MEMORY)
        if after > before:  # waiting tasks, and its share of its peers' queues
            self._gained(ws.address)  # tasks with requirements it meets
            internals.offer_unrunnable(scheduler, ws)
            internals.take_share(scheduler, ws)
        elif after < before:  # a device withdrawn: what no longer fits goes elsewhere
            internals.release_unfit(scheduler, ws, after)

    def zero(self, ws: WorkerState) -> None:
        """No GPU task is placed on ``ws`` any more (quarantine); what it was sent already
        is its guard's to send back, as it reaches execution."""
        if GPU in ws.resources:
            internals.set_worker_gpus(self.scheduler, ws, 0)
        if GPU_MEMORY in ws.resources:
            internals.set_worker_gpus(self.scheduler, ws, 0, GPU_MEMORY)

    def set_resources(
        self, original: Callable[..., Any], worker: str, resources: dict | None
    ) -> Any:
        """distributed's ``set_resources`` handler; the GPU figure is the grant's.

        Anyone can call ``set_resources`` naming any worker, so a ``GPU`` value in it
        counts for nothing: placement uses what the worker's guard offered (confirmed)
        within its grant. Other resources pass through.
        """
        scheduler = self.scheduler
        ws = scheduler.workers.get(worker)
        if ws is None or not self._active():  # unregistered: distributed's own behaviour
            return original(worker=worker, resources=resources)
        resources = dict(resources or {})
        for name in (GPU, GPU_MEMORY):
            resources.pop(name, None)
            if name in ws.resources:
                resources[name] = ws.resources[name]  # kept as this part set it
        result = internals.apply_resources(original, scheduler, worker, resources)
        self.place(ws)
        return result
