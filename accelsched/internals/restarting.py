"""The scheduler's side of a lossless restart: drain, retire (copy the keys away), check,
restart through the nanny, wait until the old process has left.

Each step is distributed's own (``handle_worker_status_change``, ``retire_workers``,
``restart_workers``); only their order is accelsched's, because only that order loses
nothing: ``Worker.close_gracefully(restart=True)`` does not check that the retirement
worked. One departure: ``retire_workers`` checks whether the worker's keys were copied
every ``len(has_what) / 400`` seconds, up to 0.5 s, so a worker holding a few hundred
results waits half a second after its last key was copied. :func:`replace_worker` watches
the same condition (every key the worker holds has another copy) every 10 ms itself and
goes on as soon as it holds; the retirement ends in the background.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from time import monotonic
from typing import TYPE_CHECKING, Any

from distributed.core import Status

if TYPE_CHECKING:
    from distributed import Scheduler
    from distributed.scheduler import WorkerState

__all__ = ["replace_worker", "resume", "has_running_peer", "take_share", "RETIRE_POLL"]

#: How often the retirement is watched (seconds).
RETIRE_POLL = 0.01
#: False: wait for ``retire_workers`` to return, as before (the restart benchmark's
#: "before" arm sets it; nothing else does).
WATCH_RETIREMENT = True


def has_running_peer(scheduler: Scheduler, ws: WorkerState) -> bool:
    return any(w is not ws for w in scheduler.running)


def _holds_sole_copy(ws: WorkerState) -> bool:
    return any(len(ts.who_has or ()) < 2 for ts in ws.has_what)


async def replace_worker(
    scheduler: Scheduler,
    ws: WorkerState,
    stimulus_id: str,
    *,
    tell_draining: Callable[[bool], Awaitable[None]],
    lock: asyncio.Lock,
    drain_timeout: float,
    gone_timeout: float,
) -> dict[str, int] | str | None:
    """Drain, retire, check, restart ``ws`` through its nanny.

    Returns the figures of a restart that happened (``moved``: keys copied away,
    ``assigned``: tasks it had then), the reason it was given up (``busy``, ``no-peer``,
    ``retire-failed``, ``restart-failed: ...``; the worker stays drained, see
    :func:`resume`), or None when it left meanwhile. ``lock`` retires and kills one worker
    at a time: while a retired worker is still registered, another retirement could drop
    the only other copy of its keys ("the retired worker still has it").
    """
    if scheduler.workers.get(ws.address) is not ws:
        return None  # it left (or another process took its address) meanwhile
    # no new tasks for it (the scheduler's side only: what it runs finishes there)
    scheduler.handle_worker_status_change(Status.closing_gracefully, ws, stimulus_id)
    assigned = len(ws.processing)
    await tell_draining(True)  # its guard sends GPU tasks back as they reach execution
    _send_queue_away(scheduler, ws)  # what has not started moves to peers
    deadline = monotonic() + drain_timeout
    while ws.processing and monotonic() < deadline:
        await asyncio.sleep(0.05)
    if ws.processing:
        return "busy"
    async with lock:
        if scheduler.workers.get(ws.address) is not ws:
            return None
        moved = len(ws.has_what)
        if not await _retire(scheduler, ws, stimulus_id):
            return "no-peer"
        if _holds_sole_copy(ws):
            return "retire-failed"
        result = await scheduler.restart_workers(
            [ws.address], wait_for_workers=False, on_error="return", stimulus_id=stimulus_id
        )
        if (said := str(result.get(ws.address))) != "OK":
            return f"restart-failed: {said}"
        deadline = monotonic() + gone_timeout  # gone from who_has before the next retirement
        while scheduler.workers.get(ws.address) is ws and monotonic() < deadline:
            await asyncio.sleep(0.01)
    return {"moved": moved, "assigned": assigned}


async def _retire(scheduler: Scheduler, ws: WorkerState, stimulus_id: str) -> bool:
    """Copy ``ws``'s unique keys to peers, keeping it registered; True when it worked."""
    outcome: list[bool | Exception] = []

    async def retirement() -> None:
        try:
            retired = await scheduler.retire_workers(
                workers=[ws.address], close_workers=False, remove=False, stimulus_id=stimulus_id
            )
            outcome.append(ws.address in retired)
        except Exception as exc:
            outcome.append(exc)

    scheduler._ongoing_background_tasks.call_soon(retirement)
    await asyncio.sleep(0)  # retire_workers marked it retiring and kicked the memory manager
    while not outcome:
        # every key it holds has another copy, and it is still the registered one
        registered = scheduler.workers.get(ws.address) is ws
        if WATCH_RETIREMENT and registered and not _holds_sole_copy(ws):
            return True
        await asyncio.sleep(RETIRE_POLL)
    if isinstance(outcome[0], Exception):
        raise outcome[0]
    return outcome[0]


def resume(scheduler: Scheduler, ws: WorkerState, previous: Status, stimulus_id: str) -> None:
    """Undo a drain that was given up: back to ``previous`` on both sides.

    A worker its memory monitor had paused stays paused (the monitor unpauses it when its
    memory allows). A failed retirement tells the worker it is closing gracefully, so the
    worker is told too; only a worker still registered under the same state is touched.
    """
    if scheduler.workers.get(ws.address) is not ws:
        return
    if previous not in (Status.running, Status.paused):
        previous = Status.running
    scheduler.stream_comms[ws.address].send(
        {"op": "worker-status-change", "status": previous.name, "stimulus_id": stimulus_id}
    )
    scheduler.handle_worker_status_change(previous, ws, stimulus_id)


def _steal(scheduler: Scheduler, ts: Any, victim: WorkerState, thief: WorkerState) -> bool:
    """Ask ``victim`` to hand the queued task ``ts`` to ``thief``, by distributed's work
    stealing protocol: the worker gives a task up only if it has not started it, so
    nothing runs twice. False when no request went out."""
    stealing = scheduler.extensions.get("stealing")
    if stealing is None:
        return False
    return stealing.move_task_request(ts, victim, thief) not in ("in-flight", "comm-closed")


def _send_queue_away(scheduler: Scheduler, ws: WorkerState) -> None:
    """Ask ``ws`` to hand each task queued on it to the least busy peer that may run it.
    Without work stealing, the guard sends the tasks back one by one as they reach
    execution instead; a drained worker would otherwise work through its whole queue,
    each task bounced through its thread pool (``Reschedule``): a second or more for a
    queue of a thousand."""
    for ts in list(ws.processing):
        valid = scheduler.valid_workers(ts)
        peers = [w for w in (scheduler.running if valid is None else valid) if w is not ws]
        if peers:
            _steal(scheduler, ts, ws, min(peers, key=lambda w: len(w.processing)))


def take_share(scheduler: Scheduler, ws: WorkerState) -> int:
    """``ws`` just offered GPUs (a new or restarted worker): take its share of the tasks
    queued on its peers, by the same protocol. distributed sends every GPU task to a
    valid worker at submission, so a worker joining later (a restarted one, whose queue
    went to its peer) would otherwise idle until work stealing evens the queues out,
    slowly for short tasks. Returns the requests sent."""
    peers = [w for w in scheduler.running if w is not ws]
    if ws not in scheduler.running or not peers:
        return 0
    fair = sum(len(w.processing) for w in (*peers, ws)) // (len(peers) + 1)
    sent = 0
    for victim in peers:
        excess = len(victim.processing) - fair
        for ts in list(victim.processing):
            if excess <= 1:
                break
            valid = scheduler.valid_workers(ts)
            if (valid is None or ws in valid) and _steal(scheduler, ts, victim, ws):
                sent += 1
                excess -= 1
    return sent
