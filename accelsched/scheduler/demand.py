"""What elastic pools ask the scheduler: the work waiting and running, and who is busy.

:func:`accelsched.adapt` asks ``accelsched_demand`` every interval for the GPU tasks by
class (requirement and device count, as :meth:`Fallback.class_of
<accelsched.scheduler.fallback.Fallback.class_of>` names them), the other tasks ready or
running, and each worker (busy or not, its verified devices); it answers
``accelsched_pools`` with the classes a starting worker will serve, which the fallback
timers go by (:meth:`Fallback.expect <accelsched.scheduler.fallback.Fallback.expect>`),
and with its pools' names, by which ``accelsched status`` shows each worker's pool.
One pass over the tasks ready or running per call: nothing is kept per task here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from accelsched import internals
from accelsched.protocol import (
    DEMAND_HANDLER,
    POOLS_HANDLER,
    ClassDemand,
    DemandReply,
    WorkerDemand,
)

if TYPE_CHECKING:
    from distributed import Scheduler

    from accelsched.scheduler.fallback import Fallback
    from accelsched.scheduler.grants import Grants

__all__ = ["Demand"]

#: Longest a starting worker may hold a task's fallback back, whatever a caller says.
MAX_BOUND = 3600.0


class Demand:
    """Serves ``accelsched_demand`` and ``accelsched_pools``."""

    def __init__(self, scheduler: Scheduler, *, fallback: Fallback, grants: Grants) -> None:
        self.scheduler = scheduler
        self._fallback = fallback
        self._grants = grants
        #: The pools ``accelsched.adapt`` sizes (its last word): worker ``<pool>-<n>``.
        self.pool_names: frozenset[str] = frozenset()

    def start(self) -> None:
        internals.install_handler(self.scheduler, DEMAND_HANDLER, self.demand)
        internals.install_handler(self.scheduler, POOLS_HANDLER, self.pools)

    def stop(self) -> None:
        internals.remove_handler(self.scheduler, DEMAND_HANDLER, self.demand)
        internals.remove_handler(self.scheduler, POOLS_HANDLER, self.pools)

    def demand(self, comm: Any = None) -> DemandReply:
        """The ``accelsched_demand`` reply."""
        gpu: dict[str, ClassDemand] = {}
        cpu_tasks, cpu_seconds = 0, 0.0
        records = self._fallback.tasks
        for ts in internals.ready_tasks(self.scheduler):
            task = records.get(ts.key)
            seconds = internals.expected_seconds(self.scheduler, ts)
            if task is None or task.fell_back or task.problem is not None:
                cpu_tasks += 1
                cpu_seconds += seconds
                continue
            name, need, devices = self._fallback.class_of(ts, task)
            entry = gpu.get(name)
            if entry is None:
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
        workers: list[WorkerDemand] = [
            {
                "name": str(ws.name),
                "address": ws.address,
                "busy": internals.busy(ws),
                "gpu_busy": internals.gpu_busy(ws),
                "gpus": len(self._grants.uuids(ws.address)),
            }
            for ws in self.scheduler.workers.values()
        ]
        return {
            "status": "OK",
            "gpu": list(gpu.values()),
            "cpu_tasks": cpu_tasks,
            "cpu_seconds": cpu_seconds,
            "workers": workers,
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
        self._fallback.expect(c, f, b)
        if names is not None:
            self.pool_names = names
        return {"status": "OK"}

    def pool_of(self, worker: str) -> str | None:
        """The pool of the worker named ``worker`` (``<pool>-<n>``), None outside any."""
        pool, _, n = worker.rpartition("-")
        return pool if n.isdigit() and pool in self.pool_names else None


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
