"""The worker's state: its declaration, its stored results, a task's execution, the
figures its heartbeat carries."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping
from time import monotonic, time
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, NamedTuple

from dask._task_spec import GraphNode, Task
from distributed.core import Status
from distributed.spill import SpillBuffer
from distributed.worker_state_machine import UnpauseEvent

from accelsched.policy.requests import valid_declaration
from accelsched.protocol import GPU, GPU_MEMORY

if TYPE_CHECKING:
    from distributed import Worker

Runner = Callable[[Any, Any], Any]
_DECLARED = "_accelsched_declared"


def declared_gpus(worker: Worker) -> object:
    """The GPU count the worker was started with, before accelsched corrected it.

    Remembered on the worker object so a re-registered guard sees the declaration, not
    its predecessor's correction.
    """
    if not hasattr(worker, _DECLARED):
        setattr(worker, _DECLARED, worker.state.total_resources.get(GPU))
    return getattr(worker, _DECLARED)


async def set_own_gpus(worker: Worker, count: int, memory: int = 0) -> None:
    """``worker.set_resources(GPU=count, GPU-memory=memory)`` (MiB), even over a
    declaration that is no number.

    ``Worker.set_resources`` adjusts availability by the difference to the old total: from
    ``"two"`` it raises, from NaN availability stays NaN and no GPU task ever starts.
    Nothing can hold such a GPU, so the count starts again from zero.
    """
    state = worker.state
    for name in (GPU, GPU_MEMORY):
        total = state.total_resources.get(name)
        if total is not None and not valid_declaration(total):
            state.total_resources[name] = state.available_resources[name] = 0
    await worker.set_resources(**{GPU: count, GPU_MEMORY: memory})
    if state.constrained and state.running:
        # distributed looks at tasks waiting for resources again only when a task ends:
        # one that arrived before these figures (the scheduler places on an offer before
        # its reply reaches the worker) would wait for an unrelated task, or for ever.
        # Unpausing a running worker changes nothing else.
        worker.handle_stimulus(UnpauseEvent(stimulus_id=f"accelsched-resources-{time()}"))


def advertises_gpus(worker: Worker) -> bool:
    return GPU in worker.state.total_resources


def worker_closing(worker: Worker) -> bool:
    """Whether the worker closes: its connections to the scheduler are going (one that
    retires, ``closing_gracefully``, still serves its guard's exchanges)."""
    return worker.status in (Status.closing, Status.closed, Status.failed)


def worker_in_service(worker: Worker) -> bool:
    """Whether the worker runs (or is paused): not closing, not being replaced."""
    return worker.status in (Status.running, Status.paused)


async def events_sent(worker: Worker, within: float = 0.1) -> None:
    """Return once the worker's batched stream to the scheduler wrote what was queued on
    it (its events), or after ``within`` seconds. A request on a connection of its own
    sent after this reaches the scheduler after them, as a rule (two connections are not
    ordered): the scheduler's answer to a restart request is then logged after the leak
    that caused it. The stream writes one batch at a time, each after the one before."""
    stream = getattr(worker, "batched_stream", None)
    if stream is None:
        return
    pause, deadline = max(stream.interval / 2, 0.001), monotonic() + within
    written = stream.byte_count
    while stream.buffer and not stream.please_stop and monotonic() < deadline:
        written = stream.byte_count  # an earlier batch written meanwhile is not ours
        await asyncio.sleep(pause)
    # taken: the write under way is ours (or ours was written already: the deadline)
    while stream.byte_count == written and not stream.please_stop and monotonic() < deadline:
        await asyncio.sleep(pause)


def plugin_modules(worker: Worker) -> list[str]:
    """Modules of the worker's plugins (dask-cuda adds its own)."""
    return [type(p).__module__ for p in getattr(worker, "plugins", {}).values()]


def _in_memory_stores(data: Any) -> list[Any] | None:
    """The mappings that hold the worker's values in memory, device objects first, each
    read without a lock (zict's LRU keeps its values in a dict: read that, not the LRU,
    whose every read takes its lock and moves the key to the end of the eviction order);
    None where the values that spilled cannot be told apart.

    - a plain dict (no spilling): itself;
    - distributed's ``SpillBuffer``: its ``fast`` dict (``slow``: on disk);
    - dask-cuda's ``DeviceHostFile`` (a ``dask cuda worker``'s, a ``LocalCUDACluster``'s):
      its ``device`` dict, its ``others`` (objects that spill themselves, cudf's) and its
      ``host`` dict. Its ``fast``, kept for distributed, is only the host's: a device
      object is never there.
    """
    if type(data) is dict:
        return [data]
    if isinstance(data, SpillBuffer):
        fast = data.fast
        return [getattr(fast, "d", fast)]
    stores = [getattr(data, name, None) for name in ("device", "others", "host")]
    if hasattr(data, "device_keys") and all(type(s) is dict for s in stores):
        return stores
    return None


def stored_values(worker: Worker) -> Callable[[Any], Any]:
    """``lookup(key)``: the value of ``key`` in the worker's memory (not read back from
    spill), or None. The worker keeps one mapping for its life: resolved once, as every
    task entering memory is looked up."""
    stores = _in_memory_stores(worker.data)
    if stores is not None and len(stores) == 1:
        return stores[0].get
    if stores is not None:  # a DeviceHostFile
        device, others, host = stores
        data: Any = worker.data
        spilled_from = data.device_keys  # (a device object in the host dict: spilled)

        def found(key: Any) -> Any:
            if (value := device.get(key)) is not None or (value := others.get(key)) is not None:
                return value
            return None if key in spilled_from else host.get(key)

        return found
    fast = getattr(worker.data, "fast", worker.data)

    def lookup(key: Any) -> Any:
        try:
            return fast.get(key)
        except Exception:  # a value that cannot be read back is not counted
            return None

    return lookup


class Residence(NamedTuple):
    """Where a worker's values are: ``holds(key)``, whether the value of ``key`` is in its
    memory now rather than spilled (its device memory then went back); ``any_out()``,
    whether any is spilled now (a length or two: most checks need no more)."""

    holds: Callable[[Any], bool]
    any_out: Callable[[], bool]


def in_memory(worker: Worker) -> Residence | None:
    """Where the worker's values are (:class:`Residence`): spilled to disk by
    distributed's ``SpillBuffer``, to the host by dask-cuda's ``DeviceHostFile``; None
    where nothing spills (a plain dict) or a spilled value cannot be told apart."""
    data: Any = worker.data
    stores = _in_memory_stores(data)
    if stores is None or type(data) is dict:
        return None
    if len(stores) == 1:  # a SpillBuffer
        slow = data.slow
        return Residence(stores[0].__contains__, lambda: len(slow) > 0)
    # only a device object spills off the device (its key is in device_keys, wherever it
    # is): any other value, in others or the host dict, is where it was made (a result
    # holding device memory that dask-cuda does not take for a device object, as a
    # model on the GPU, is kept in the host dict and is on the device all the same)
    device, keys = stores[0], data.device_keys
    return Residence(lambda key: key not in keys or key in device, lambda: len(keys) > len(device))


_IN_THREAD = frozenset({"executing", "long-running"})


def runs_in_thread(worker: Worker, key: Any) -> bool:
    """Whether ``key``'s function is running in one of the worker's threads now.

    A task released while it executes becomes ``cancelled`` (or ``resumed``), yet its
    thread runs on until the function returns: distributed cannot stop it. Its state
    then keeps where it came from in ``previous``, and ``done`` once the thread ended.
    """
    ts = worker.state.tasks.get(key)
    return ts is not None and (
        ts.state in _IN_THREAD
        or (ts.state in ("cancelled", "resumed") and ts.previous in _IN_THREAD and not ts.done)
    )


def tasks_in_threads(worker: Worker) -> dict[Any, bool]:
    """The keys whose functions run in the worker's threads now (see
    :func:`runs_in_thread`), each with whether it asked for a GPU: one pass over its
    tasks, for a guard set up mid-run."""
    tasks = worker.state.tasks
    return {
        key: (tasks[key].resource_restrictions or _EMPTY).get(GPU, 0) > 0
        for key in list(tasks)
        if runs_in_thread(worker, key)
    }


def wrap_execution(
    worker: Worker,
    key: Any,
    choose: Callable[..., Runner | None],
    *args: Any,
) -> None:
    """Let ``choose(key, resources, annotations, *args)`` wrap the task ``key`` as it
    starts executing (worker event loop).

    ``choose`` returns a runner ``runner(spec, values)`` that runs the task in the
    executor thread (``spec(values)``), or None to leave it. Coroutine tasks and tasks
    for an executor that is not a thread pool (another process runs them) are left
    alone: nothing can be bound there.
    """
    ts = worker.state.tasks.get(key)
    if ts is None or (spec := ts.run_spec) is None or _is_coro(spec):
        return
    annotations = ts.annotations or _EMPTY
    # distributed's executor is its own copy of ``ThreadPoolExecutor``, not a subclass of
    # ``concurrent.futures``'s: go by name (once per executor type)
    cls = type(worker.executors.get(annotations.get("executor", "default")))
    if (thread_pool := _THREAD_POOLS.get(cls)) is None:
        thread_pool = _THREAD_POOLS[cls] = any(
            c.__name__ == "ThreadPoolExecutor" for c in cls.__mro__
        )
    if not thread_pool:
        return
    runner = choose(key, ts.resource_restrictions or _EMPTY, annotations, *args)
    if runner is not None:
        ts.run_spec = wrap_task(spec, runner)


_EMPTY: Mapping[str, Any] = MappingProxyType({})


def _is_coro(spec: Any) -> bool:
    """``spec.is_coro``, known per function: a ``Task`` made per task computes it anew
    (``inspect``, some microseconds) for the function all tasks of a kind share."""
    func = getattr(spec, "func", None)
    if func is None or type(spec) is not Task:
        return bool(spec.is_coro)
    try:
        known = _COROUTINES.get(func)
    except Exception:  # an unhashable callable (or one whose hash fails)
        return bool(spec.is_coro)
    if known is None:
        if len(_COROUTINES) >= _MAX_FUNCTIONS:  # functions made per task: start over
            _COROUTINES.clear()
        known = _COROUTINES[func] = bool(spec.is_coro)
    return known


_COROUTINES: dict[Any, bool] = {}
_MAX_FUNCTIONS = 1024


_THREAD_POOLS: dict[type, bool] = {}


class Bound(GraphNode):
    """A task's own spec, run by ``runner(spec, values)`` in the executor thread.

    The worker calls its run spec with the dependencies' values and asks nothing else of
    it but ``is_coro`` (False: coroutines are never wrapped) and its ``repr`` (in a failed
    task's log line); ``data_producer`` only the scheduler reads: this node keeps the spec's
    key and dependencies and hands the values to the runner as they came. It is made per
    GPU task on the worker's event loop, so it costs two slots, not a new ``Task`` (whose
    construction walks its arguments).
    """

    __slots__ = ("spec", "runner")

    def __init__(self, spec: Any, runner: Runner) -> None:
        self.key = spec.key
        self._dependencies = spec.dependencies
        self.spec = spec
        self.runner = runner

    def __call__(self, values: Any = ()) -> Any:
        return self.runner(self.spec, values)

    def __repr__(self) -> str:
        return repr(self.spec)


def wrap_task(spec: Any, runner: Runner) -> Any:
    """``spec`` run by ``runner(spec, values)`` (:class:`Bound`). Wrapping twice is a
    no-op."""
    return spec if isinstance(spec, Bound) else Bound(spec, runner)


def add_metric(worker: Worker, name: str, fn: Callable[[Any], Any]) -> None:
    """Send ``fn(worker)`` with every heartbeat under ``name`` (a custom worker metric:
    ``Worker.metrics`` is read at each heartbeat, so one added later still travels).

    The dict is replaced, never changed in place: ``Worker.get_metrics`` awaits between
    its items, so a guard set up during a heartbeat would change it mid-iteration
    (``RuntimeError: dictionary changed size during iteration``).
    """
    worker.metrics = {**worker.metrics, name: fn}


async def heartbeat_now(worker: Worker) -> None:
    """A heartbeat now, from a running worker, so the scheduler's view of its metrics is
    not the last periodic one's (a metric removed is gone before the next). It is
    distributed's own: a failure is handled (logged, the worker closed when the scheduler
    says it left) as the periodic one's would be; only what that re-raises is dropped."""
    if worker.status != Status.running:
        return
    with contextlib.suppress(Exception):
        await worker.heartbeat()


def remove_metric(worker: Worker, name: str, fn: Callable[[Any], Any]) -> None:
    """Stop sending ``name``, if it is still ``fn`` (not a newer guard's)."""
    if worker.metrics.get(name) == fn:
        worker.metrics = {k: v for k, v in worker.metrics.items() if k != name}
