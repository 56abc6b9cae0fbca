"""The scheduler's side of a lossless restart: retire (copy the keys away), restart
through the nanny, wait until the old process has left.

distributed's ``retire_workers`` checks whether the worker's keys have been copied every
``len(has_what) / 400`` seconds, up to 0.5 s: a worker holding a few hundred results
waits half a second after its last key was copied, and once more if the copy took just
longer than one poll. :func:`retire` runs the same retirement and watches the same
condition (every key the worker holds has another copy) every 10 ms itself, returning as
soon as it holds; the retirement ends in the background (its next poll sees it done).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from accelsched.internals.scheduler import holds_sole_copy

if TYPE_CHECKING:
    from distributed import Scheduler
    from distributed.scheduler import WorkerState

__all__ = ["retire", "restart", "wait_gone", "send_queue_away", "take_share", "RETIRE_POLL"]

#: How often :func:`retire` looks whether every key has another copy (seconds).
RETIRE_POLL = 0.01
#: False: wait for ``retire_workers`` to return, as before (the restart benchmark's
#: "before" arm sets it; nothing else does).
WATCH_RETIREMENT = True


async def retire(scheduler: Scheduler, ws: WorkerState, stimulus_id: str) -> bool:
    """Copy ``ws``'s unique keys to peers, keeping it registered; True when it worked."""
    if not WATCH_RETIREMENT:
        retired = await scheduler.retire_workers(
            workers=[ws.address], close_workers=False, remove=False, stimulus_id=stimulus_id
        )
        return ws.address in retired
    loop = asyncio.get_running_loop()
    outcome: asyncio.Future[Any] = loop.create_future()
    outcome.add_done_callback(_retrieve)  # nobody waits for it once the copies exist

    async def retirement() -> None:
        try:
            retired = await scheduler.retire_workers(
                workers=[ws.address], close_workers=False, remove=False, stimulus_id=stimulus_id
            )
        except Exception as exc:
            if not outcome.done():
                outcome.set_exception(exc)
        else:
            if not outcome.done():
                outcome.set_result(ws.address in retired)

    scheduler._ongoing_background_tasks.call_soon(retirement)
    await asyncio.sleep(0)  # retire_workers has marked the worker retiring and kicked the
    while not outcome.done():  # memory manager to copy its keys
        if _copied(scheduler, ws):
            return True
        await asyncio.wait({outcome}, timeout=RETIRE_POLL)
    return outcome.result()


def _copied(scheduler: Scheduler, ws: WorkerState) -> bool:
    """Every key ``ws`` holds has another copy, and ``ws`` is still the registered one."""
    return scheduler.workers.get(ws.address) is ws and not holds_sole_copy(ws)


def _retrieve(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


def send_queue_away(scheduler: Scheduler, ws: WorkerState) -> int:
    """Ask ``ws`` to hand each task assigned to it to a peer that may run it, the way
    distributed's work stealing moves a queued task: the worker gives up a task only if
    it has not started it (what runs finishes there), so nothing runs twice. Returns the
    number of requests sent; without work stealing, none (the guard sends the tasks back
    one by one as they reach execution instead).

    A drained worker otherwise works through its whole queue, each task bounced through
    its thread pool (``Reschedule``): a second or more for a queue of a thousand.
    """
    stealing = scheduler.extensions.get("stealing")
    if stealing is None:
        return 0
    sent = 0
    for ts in list(ws.processing):
        valid = scheduler.valid_workers(ts)
        peers = [w for w in (scheduler.running if valid is None else valid) if w is not ws]
        if not peers:
            continue
        thief = min(peers, key=lambda w: len(w.processing))
        if stealing.move_task_request(ts, ws, thief) not in ("in-flight", "comm-closed"):
            sent += 1
    return sent


def take_share(scheduler: Scheduler, ws: WorkerState) -> int:
    """``ws`` just offered GPUs (a new or restarted worker): take its share of the tasks
    queued on its peers, by the same protocol as :func:`send_queue_away`. distributed
    sends every GPU task to a valid worker at submission, so a worker joining later (a
    restarted one, whose queue went to its peer) would otherwise idle until work stealing
    evens the queues out, slowly for short tasks. Returns the requests sent."""
    stealing = scheduler.extensions.get("stealing")
    peers = [w for w in scheduler.running if w is not ws]
    if stealing is None or ws not in scheduler.running or not peers:
        return 0
    fair = sum(len(w.processing) for w in (*peers, ws)) // (len(peers) + 1)
    sent = 0
    for victim in peers:
        excess = len(victim.processing) - fair
        for ts in list(victim.processing):
            if excess <= 1:
                break
            valid = scheduler.valid_workers(ts)
            if valid is not None and ws not in valid:
                continue
            if stealing.move_task_request(ts, victim, ws) not in ("in-flight", "comm-closed"):
                sent += 1
                excess -= 1
    return sent


async def restart(scheduler: Scheduler, ws: WorkerState, stimulus_id: str) -> str:
    """Restart ``ws`` through its nanny; returns distributed's word for it (``"OK"``)."""
    result = await scheduler.restart_workers(
        [ws.address], wait_for_workers=False, on_error="return", stimulus_id=stimulus_id
    )
    return str(result.get(ws.address))


async def wait_gone(scheduler: Scheduler, ws: WorkerState, timeout: float) -> None:
    """Wait until ``ws`` left the scheduler (its keys gone from ``who_has``)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while scheduler.workers.get(ws.address) is ws and loop.time() < deadline:
        await asyncio.sleep(0.01)
