"""What the command line, elastic pools and :mod:`accelsched.testing` borrow from
distributed: address schemes, the scheduler file, a worker spec's class, retiring workers
by name, the cluster's adaptive controller and its worker objects, starting one more
SpecCluster worker, and distributed's own NVML diagnostics.

distributed.diagnostics.nvml remembers "no NVML" for the life of the process, and once
initialized it adds GPU metrics to every worker started in-process.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any


def check_scheme(scheme: str) -> None:
    """Raise ``ValueError`` when distributed knows no comm backend for ``scheme``, or its
    backend cannot connect from this process (``ucx`` without its package: distributed
    keeps an abstract stand-in)."""
    from distributed.comm.registry import get_backend

    backend = get_backend(scheme)
    try:
        backend.get_connector()
    except Exception as exc:
        raise ValueError(
            f"distributed's {scheme!r} transport cannot connect from here (is its package "
            f"installed?): {type(exc).__name__}: {exc}"
        ) from None


def read_json_file(path: str, load: Callable[[Any], Any], timeout: float) -> Any:
    """distributed's own reader of a scheduler file: retries a file still being written
    until ``timeout`` (``TimeoutError`` after it), as ``Client(scheduler_file=...)`` does."""
    from distributed.utils import json_load_robust

    return json_load_robust(path, load=load, timeout=timeout)


def spec_class(cls: Any) -> Any:
    """A worker spec's ``cls`` as ``SpecCluster`` reads it: a class, or its import path."""
    from distributed.utils import import_term

    return import_term(cls) if isinstance(cls, str) else cls


def built_or_failed(cls: Any) -> Callable[..., Any]:
    """A worker spec's ``cls`` for ``SpecCluster`` that never raises as it builds: a worker
    whose class raises when built (a bad option, as ``memory_limit="lots"``) becomes one
    whose start fails with that error, so :func:`start_failed` sees it. ``SpecCluster``
    builds every new worker in one loop and starts them after: one that raised there
    kept every other, of any pool, from starting, and left no worker object to tell."""
    from distributed.deploy.spec import ProcessInterface

    cls = spec_class(cls)

    class NotBuilt(ProcessInterface):
        def __init__(self, error: Exception) -> None:
            super().__init__()
            self.build_error = error

        async def start(self) -> None:
            raise self.build_error

    def build(*args: Any, **kwargs: Any) -> Any:
        try:
            return cls(*args, **kwargs)
        except Exception as exc:
            return NotBuilt(exc)

    build.__name__ = build.__qualname__ = f"built_or_failed({getattr(cls, '__name__', cls)})"
    return build


def build_error(cluster: Any, name: str) -> str | None:
    """What the class of ``cluster``'s worker ``name`` raised as it was built (see
    :func:`built_or_failed`), said in a line; None if it was built."""
    error = getattr(cluster.workers.get(name), "build_error", None)
    return None if error is None else f"{type(error).__name__}: {error}"


def cpu_count() -> int:
    """The threads a worker given no ``nthreads`` (or 0) runs, as distributed counts
    this host's cores."""
    from dask.system import CPU_COUNT

    return int(CPU_COUNT)


def workers_listed(client: Any) -> dict[str, dict[str, Any]]:
    """The scheduler's workers by address, each as ``client.scheduler_info(n_workers=-1)``
    describes it, fetched for this call (a synchronous client).

    ``scheduler_info`` refreshes the client's cached identity and returns that attribute,
    which the client's periodic refresh (``distributed.client.scheduler-info-interval``)
    replaces with one listing no worker: landing in between, it makes a call list none
    (measured: 1 call in about 70,000 on a busy 2-core host), which a loop waiting for
    workers to go takes for their departure."""
    if client.asynchronous:
        raise TypeError(
            "workers_listed() takes a synchronous client; with an asynchronous one, "
            "await client.scheduler.identity(n_workers=-1)"
        )
    return dict(client.sync(client.scheduler.identity, n_workers=-1)["workers"])


def worker_class(cls: Any) -> bool:
    """Whether a worker spec's class can start a worker: a server (``Nanny``,
    ``Worker``) or a process a cluster manages (a dask-jobqueue job)."""
    from distributed import Scheduler
    from distributed.core import Server
    from distributed.deploy.spec import ProcessInterface

    return (
        isinstance(cls, type)
        and issubclass(cls, (Server, ProcessInterface))
        and not issubclass(cls, Scheduler)
    )


async def retire_named(scheduler_comm: Any, names: list[str], *, close: bool = False) -> set[str]:
    """Retire workers by name through the scheduler (their data copied to peers first, as
    ``Adaptive.scale_down`` does); the names it did retire. A worker whose data no peer
    can take is not retired: it keeps running, and its data. A retired worker stays
    registered, closing gracefully (no heartbeat of a removed worker that is still up),
    until its cluster closes it, or (``close``) the scheduler closes it with its nanny,
    as ``Adaptive.scale_down`` does before its cluster's own, slower close (which also
    removes it; here it goes as it disconnects)."""
    retired = await scheduler_comm.retire_workers(names=names, remove=False, close_workers=close)
    return {str(info.get("name")) for info in (retired or {}).values()}


def cluster_holds(cluster: Any, name: str) -> bool:
    """Whether ``cluster`` still holds a worker object named ``name``: a ``SpecCluster``
    starts a spec's worker only where it holds none, so a new worker given that name would
    never start."""
    return name in cluster.workers


def start_failed(cluster: Any, name: str) -> bool:
    """Whether ``cluster``'s worker ``name`` failed to start or has closed: a ``Nanny`` or
    ``Worker`` failed or closed, or a job whose submission failed (still ``created``: a
    ``SpecCluster`` holds an object only once its start returned or raised; a job a queue
    holds is running). The cluster keeps such an object, and never starts that spec
    again."""
    from distributed.core import Status

    worker = cluster.workers.get(name)
    return getattr(worker, "status", None) in (Status.failed, Status.closed, Status.created)


def lost_worker_timeout() -> float:
    """Seconds after a worker leaves the scheduler that a ``SpecCluster`` closes the
    worker object it holds under that worker's name (``distributed.deploy.
    lost-worker-timeout``)."""
    import dask
    from dask.utils import parse_timedelta

    return float(parse_timedelta(dask.config.get("distributed.deploy.lost-worker-timeout")))


def correct(cluster: Any) -> None:
    """Let ``cluster`` start the workers its spec has and it has not (in the background):
    ``SpecCluster.scale`` at its own size. Not the cluster's own ``scale``, which a
    subclass may read otherwise (dask-jobqueue's counts workers, and divides them by the
    processes of its default job: a pool's new spec would go)."""
    from distributed import SpecCluster

    SpecCluster.scale(cluster, len(cluster.worker_spec))


def take_adaptive(cluster: Any, controller: Any) -> Any:
    """Make ``controller`` the cluster's one adaptive controller, as ``Cluster.adapt``
    does: the one before is stopped, and closing the cluster or a later ``cluster.adapt()``
    stops this one (two controllers would fight over one cluster's workers). Returns the
    one before if it was sizing the cluster (starting or running), else None."""
    previous = getattr(cluster, "_adaptive", None)
    cluster._adaptive = controller
    if previous is None or previous is controller:
        return None
    active = getattr(previous, "state", None) in ("starting", "running")
    previous.stop()
    return previous if active else None


def distributed_nvml_state() -> tuple[Any, ...] | None:
    nvml: Any = sys.modules.get("distributed.diagnostics.nvml")
    worker: Any = sys.modules.get("distributed.worker")
    if nvml is None:
        return None
    return (
        nvml.NVML_STATE,
        nvml.NVML_OWNER_PID,
        "gpu" in getattr(worker, "DEFAULT_METRICS", {}),
        "gpu" in getattr(worker, "DEFAULT_STARTUP_INFORMATION", {}),
    )


def reset_distributed_nvml() -> None:
    """Make distributed look for NVML again (it found none before fake GPUs existed)."""
    nvml: Any = sys.modules.get("distributed.diagnostics.nvml")
    if nvml is not None and nvml.NVML_STATE == nvml.NVMLState.DISABLED_LIBRARY_NOT_FOUND:
        nvml.NVML_STATE = nvml.NVMLState.UNINITIALIZED


def restore_distributed_nvml(saved: tuple[Any, ...] | None) -> None:
    nvml: Any = sys.modules.get("distributed.diagnostics.nvml")
    if nvml is None:
        return
    if saved is None:  # imported during the session: as if it had never looked
        saved = (nvml.NVMLState.UNINITIALIZED, None, False, False)
    nvml.NVML_STATE, nvml.NVML_OWNER_PID, had_metrics, had_startup = saved
    worker: Any = sys.modules.get("distributed.worker")
    for table, had in (
        ("DEFAULT_METRICS", had_metrics),
        ("DEFAULT_STARTUP_INFORMATION", had_startup),
    ):
        if worker is not None and not had:
            getattr(worker, table).pop("gpu", None)


def add_spec_worker(cluster: Any, name: str, spec: dict[str, Any]) -> None:
    """Start one more worker of a running SpecCluster (a LocalCUDACluster, say)."""
    cluster.worker_spec[name] = spec
    cluster.sync(cluster._correct_state)
