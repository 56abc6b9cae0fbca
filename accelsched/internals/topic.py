"""The ``accelsched`` event topic: written by the scheduler alone.

The event log is the source of ``accelsched status``'s counts, the metrics and the
dashboard's history; distributed lets any client and any task log under any topic.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from accelsched.internals.scheduler import ORIGINAL

if TYPE_CHECKING:
    from distributed import Scheduler

logger = logging.getLogger(__name__)


def reserve_topic(
    scheduler: Scheduler, topic: str, op: str, on_worker_event: Callable[..., None]
) -> None:
    """Keep ``topic`` for the scheduler's own ``log_event`` calls.

    Any client (``Client.log_event``) and any task (``Worker.log_event``) may log under
    any topic: a forged ``restart`` or ``leak`` would count for a worker. The topic is
    refused from clients and dropped from workers' ``log-event`` messages; guards send
    their events as ``op`` on their worker's stream, stamped with its address by
    distributed (which a message naming another worker overrides: the handler checks
    its token), to ``on_worker_event(worker, msg, token)``. :func:`release_topic` undoes
    it."""
    _refuse_client_topic(scheduler, topic)
    stream = scheduler.stream_handlers["log-event"]
    stream = getattr(stream, ORIGINAL, stream)
    reserved = topic  # the handler's own parameter is named ``topic``, as distributed's

    def log_worker_event(worker: str = "", topic: Any = None, msg: Any = None) -> Any:
        topics = _topics(topic)
        if reserved in topics:
            others = [t for t in topics if t != reserved]
            logger.warning("accelsched: dropped a %r event %s logged itself", reserved, worker)
            return stream(worker=worker, topic=others, msg=msg) if others else None
        return stream(worker=worker, topic=topic, msg=msg)

    setattr(log_worker_event, ORIGINAL, stream)
    scheduler.stream_handlers["log-event"] = log_worker_event
    scheduler.stream_handlers[op] = on_worker_event


def release_topic(scheduler: Scheduler, topic: str, op: str) -> None:
    """Undo :func:`reserve_topic`: distributed's own handlers again. Guards still send
    ``op`` (an unknown op would close their worker's stream): logged as plain events."""
    handler = scheduler.handlers["log_event"]
    scheduler.handlers["log_event"] = getattr(handler, ORIGINAL, handler)
    stream = scheduler.stream_handlers["log-event"]
    stream = scheduler.stream_handlers["log-event"] = getattr(stream, ORIGINAL, stream)

    def as_plain_event(worker: str = "", msg: Any = None, **_: Any) -> Any:
        return stream(worker=worker, topic=topic, msg=msg)

    scheduler.stream_handlers[op] = as_plain_event


def _refuse_client_topic(scheduler: Scheduler, topic: str) -> None:
    """Refuse ``topic`` in the scheduler's ``log_event`` handler (``Client.log_event``)."""
    original = scheduler.handlers["log_event"]
    original = getattr(original, ORIGINAL, original)
    refused = topic

    def log_event(topic: Any = None, msg: Any = None) -> Any:  # distributed's parameters
        if refused in _topics(topic):
            msg_ = f"the {refused!r} event topic is written by accelsched alone; log to yours"
            raise PermissionError(msg_)
        return original(topic=topic, msg=msg)

    setattr(log_event, ORIGINAL, original)
    scheduler.handlers["log_event"] = log_event


def _topics(topic: Any) -> list[Any]:
    """The topics ``Scheduler.log_event`` will log under: one string, or each item of
    whatever else it is given (a list, a tuple, a set: msgpack keeps them all)."""
    if isinstance(topic, str):
        return [topic]
    try:
        return list(topic)
    except TypeError:
        return [topic]
