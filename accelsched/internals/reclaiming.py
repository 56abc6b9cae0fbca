"""What the guard's reclaim asks of the worker: is a GPU task still in a thread?

A failed task's thread holds its exception (and the traceback, and the frames' device
arrays) until the worker has handled the failure, which can come well after the task
released its device: memory measured then looks held even to ``gc.collect()``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from accelsched.protocol import GPU

if TYPE_CHECKING:
    from distributed import Worker

__all__ = ["gpu_tasks_in_threads"]


def gpu_tasks_in_threads(worker: Worker) -> set[Any]:
    """The keys of tasks restricted to GPUs executing in ``worker``'s threads (its state
    machine's ``executing`` and ``long_running`` sets, cancelled ones included)."""
    state = worker.state
    return {
        ts.key
        for ts in (*state.executing, *state.long_running)
        if (ts.resource_restrictions or {}).get(GPU, 0) > 0
    }
