"""What a decision suggests: one shape for every decision, one place per side that acts.

distributed's Active Memory Manager has its policies yield ``Suggestion`` objects and
acts on them in one place; accelsched does the same. Every decision in this folder that
calls for an action answers with :class:`Proposal` objects; nothing here acts. On the
scheduler, :mod:`accelsched.scheduler.placement_plugin` carries them out; on a worker,
:class:`accelsched.worker.leak_check.WorkerActor`. A test can therefore check a decision
by the proposals it returns, with numbers, and check an actor by the proposals it is given.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal, get_args

__all__ = ["Action", "Proposal"]

Action = Literal[
    # on the scheduler (subject: a task key or a worker)
    "fall-back",  # a GPU task runs its CPU form now (reason: why; figures: waited)
    "err",  # a GPU task that can never be placed errs (reason: why, naming the value)
    "restart",  # drain, retire and restart a worker, losing nothing
    "defer",  # a restart cannot happen without loss now: say so, its GPUs leave placement
    "quarantine",  # over its restart budget: its GPUs leave placement, no restart
    # on a worker (subject: a CUDA index of the worker's devices)
    "withdraw",  # a device stops answering NVML: offer it no more (detail: uuid, error)
    "recover",  # a withdrawn device answered steadily again: offer it again (detail: uuid)
    "report-leak",  # a confirmed leak is news: say so (figures: nbytes, threshold, ...)
    "reclaim",  # collect garbage and free pools on the device before asking for a restart
    "report-reclaimed",  # a reclaim gave a confirmed leak back: say so, no restart
    # subject: the devices that call for it, a tuple (one request for all of them)
    "ask-restart",  # ask the scheduler to restart this worker (reason; figures: nbytes)
]


@dataclass(frozen=True)
class Proposal:
    """One action a decision suggests about one subject.

    ``reason`` is the word the action's event or reply carries (``"timeout"``,
    ``"budget"``, ``"no-peer"``, ...); ``figures`` the numbers it needs (seconds waited,
    bytes estimated), read-only; ``detail`` what its event says that is no number (a
    device's UUID and error, a leak's suspects), read-only too.
    """

    action: Action
    subject: Hashable
    reason: str | None = None
    figures: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))
    detail: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    def __post_init__(self) -> None:
        if self.action not in get_args(Action):
            raise ValueError(f"unknown action {self.action!r}")
        for name in ("figures", "detail"):  # read-only, whatever the caller keeps
            object.__setattr__(self, name, MappingProxyType(dict(getattr(self, name))))
