"""What a worker claims, which of its requests to act on, and how many restarts:
decisions only, no distributed import.

Which devices a worker owns and what GPU count it asks for (:func:`owned`,
:func:`decide_claim`): the worker side decides, and the scheduler grants one owner per
GPU UUID so two workers never drive the same device unless sharing is configured (who
owns what is the scheduler's grants, :meth:`accelsched.scheduler.grants.Grants.claim`,
kept there alone).

Nothing here authenticates anyone: in distributed, anyone connected is trusted (any
client may run code on the scheduler; TLS keeps strangers out; docs/architecture.md).
What this guards against are accidents. A request names the worker address it speaks
for and the process that sent it (distributed's ``Worker.id``, the scheduler's
``WorkerState.server_id``), and carries an id that process never uses twice:

- a late request from a process that was replaced (a restart's second request, arriving
  after the new process registered at the same address) must not restart the fresh one;
- a request handled twice (replayed, retried) is acted on once.

How many guard restarts to allow (:class:`RestartBudget`): a worker that leaks on every
task would otherwise be restarted in a loop, and several workers restarting at once can
take a cluster's capacity down together. The budget allows ``max_restarts`` per worker
per ``window`` seconds and ``max_concurrent`` restarts in flight across the cluster;
past it the PlacementPlugin quarantines instead.

:func:`admit_restart` answers a worker's restart request with a
:class:`~accelsched.policy.proposals.Proposal` (``restart``, ``defer`` or
``quarantine``) or None; :func:`restart_reply` is the reply the worker gets for it.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TypeVar

from accelsched.policy.proposals import Proposal
from accelsched.protocol import RestartReply

__all__ = [
    "owned",
    "Claim",
    "decide_claim",
    "valid_declaration",
    "declared_count",
    "Requests",
    "RestartBudget",
    "admit_restart",
    "restart_reply",
    "keeps_devices",
    "grant",
]

T = TypeVar("T")


def owned(visible: Sequence[T], *, under_dask_cuda: bool) -> list[T]:
    """The devices a worker owns among those it can see.

    A plain worker owns every device in its ``CUDA_VISIBLE_DEVICES``. dask-cuda starts
    one worker per GPU and gives each all GPUs in rotated order ("1,0", "0,1"), so there
    a worker owns exactly its first visible device. A MIG device is a device here: the
    monitor already cut the list to what CUDA enumerates (one MIG device per process).
    """
    return list(visible[:1]) if under_dask_cuda else list(visible)


@dataclass(frozen=True)
class Claim:
    """The GPU count a worker asks the scheduler for, and why it differs from its
    declaration. (What the scheduler grants may be less: see
    :meth:`accelsched.scheduler.grants.Grants.claim`.)"""

    count: int
    reason: str | None  # None: the declaration was right


def valid_declaration(declared: object) -> bool:
    """A declared GPU count distributed can place against: a finite number >= 0."""
    return (
        isinstance(declared, (int, float))
        and not isinstance(declared, bool)
        and math.isfinite(declared)
        and declared >= 0
    )


def declared_count(declared: object) -> float | None:
    """The declaration as a count for the scheduler's events; None when it is none."""
    return declared if isinstance(declared, (int, float)) and valid_declaration(declared) else None


def decide_claim(declared: object, owned_count: int, *, advertise_undeclared: bool) -> Claim:
    """GPU count a worker should ask for, given what it declared and what it owns.

    A declaration that is no count at all (``"two"``, NaN, -1) claims nothing; the reason
    names it, so the scheduler's ``gpu-corrected`` event says why.
    """
    if declared is not None and not valid_declaration(declared):
        return Claim(0, f"invalid-declaration: {declared!r}")
    assert declared is None or isinstance(declared, (int, float))
    if declared is None or declared == 0:
        if owned_count and advertise_undeclared:
            return Claim(owned_count, "advertised")
        return Claim(0, None)
    if owned_count == 0:
        return Claim(0, "no-devices")
    if declared > owned_count:
        return Claim(owned_count, "fewer-devices")
    # fewer GPUs than the worker sees (or as many): the declaration is honoured
    return Claim(int(declared), None)


class Requests:
    """The request ids seen from each worker address, while its process is registered."""

    def __init__(self) -> None:
        self._seen: dict[str, set[str]] = {}  # worker -> ids acted on

    def refusal(
        self, worker: str, process: object, registered: str | None, request: object
    ) -> str | None:
        """Why a request naming ``worker``, sent by ``process``, is not acted on, with
        ``registered`` the process the scheduler holds at that address (None: no worker
        there); None: act on it (its id is spent). The reasons: ``"stale"``,
        ``"no-id"``, ``"replayed"``."""
        if registered is None or process != registered:
            return "stale"
        if not isinstance(request, str) or not request:
            return "no-id"
        seen = self._seen.setdefault(worker, set())
        if request in seen:
            return "replayed"
        seen.add(request)
        return None

    def forget(self, worker: str) -> None:
        """The worker left: a process registering at its address starts afresh."""
        self._seen.pop(worker, None)


@dataclass
class RestartBudget:
    """The restarts allowed (the options, validated where they are read:
    :data:`accelsched.config.PLACEMENT_OPTIONS`) and those taken."""

    max_restarts: int
    window: float
    max_concurrent: int = 1
    _history: dict[str, deque[float]] = field(default_factory=dict)
    _in_flight: set[str] = field(default_factory=set)

    def request(self, key: str, now: float) -> str | None:
        """Why ``key`` may not restart now (``in-flight``, ``budget``, ``concurrency``);
        None: it may, and a restart that :meth:`done` ends starts."""
        for other, history in list(self._history.items()):  # restarts that left the window
            while history and history[0] <= now - self.window:
                history.popleft()
            if not history:  # workers come and go: keep only recent restarts
                del self._history[other]
        if key in self._in_flight:
            return "in-flight"
        if len(self._history.get(key, ())) >= self.max_restarts:
            return "budget"
        if len(self._in_flight) >= self.max_concurrent:
            return "concurrency"
        self._in_flight.add(key)
        self._history.setdefault(key, deque()).append(now)
        return None

    def done(self, key: str, *, counted: bool = True) -> None:
        """The restart of ``key`` ended; ``counted=False`` when it never happened."""
        self._in_flight.discard(key)
        if not counted and self._history.get(key):
            self._history[key].pop()

    @property
    def in_flight(self) -> frozenset[str]:
        return frozenset(self._in_flight)

    def held_to(self, limits: RestartBudget) -> RestartBudget:
        """This budget's record of the restarts taken and under way, held to the limits of
        ``limits`` (the budget of a PlacementPlugin registered again, with other
        options): the same record, not a copy, as a restart under way ends on it
        (:meth:`done`)."""
        return replace(
            self,
            max_restarts=limits.max_restarts,
            window=limits.window,
            max_concurrent=limits.max_concurrent,
        )


def admit_restart(
    budget: RestartBudget,
    key: str,
    now: float,
    *,
    worker: str,
    why: str,
    has_nanny: bool,
    has_peer: bool,
) -> Proposal | None:
    """What to do about ``worker``'s request to be restarted because of ``why``.

    The request was admitted as the worker's own (a stranger's is refused before it
    gets here: :class:`Requests`). ``has_nanny``: something can
    start it again. ``has_peer``: another running worker can take its data (or it has
    none, and runs nothing). ``key``
    identifies the worker across restarts (its nanny), for the budget.

    ``restart`` (reason: ``why``, what its event says) starts it; ``defer`` (reason:
    ``no-nanny``, ``no-peer``, ``concurrency``) means it cannot happen without loss now;
    ``quarantine`` (reason ``budget``) means it restarted too often lately. None: nothing
    to do (its restart is already under way). Only an admitted restart takes budget.
    """
    if not has_nanny:
        return Proposal("defer", worker, "no-nanny")
    if not has_peer:
        return Proposal("defer", worker, "no-peer")
    refusal = budget.request(key, now)
    if refusal is None:
        return Proposal("restart", worker, why)
    if refusal == "in-flight":
        return None
    if refusal == "budget":
        return Proposal("quarantine", worker, "budget")
    return Proposal("defer", worker, refusal)


def restart_reply(proposal: Proposal | None, *, authentic: bool = True) -> RestartReply:
    """The ``accelsched_restart`` reply for what :func:`admit_restart` proposed.

    The worker's guard reads it to know whether to ask again later: ``accepted`` (it
    restarts), ``deferred`` with the reason (it may ask again), ``in-flight`` (already
    restarting), ``refused`` (not its own request).
    """
    if proposal is None:
        return {"status": "in-flight" if authentic else "refused"}
    if proposal.action == "restart":
        return {"status": "accepted"}
    return {"status": "deferred", "reason": str(proposal.reason)}  # defer, quarantine


def keeps_devices(why: str) -> bool:
    """Whether a worker keeps its GPUs in placement while its restart waits or fails.

    A leaking worker must take no GPU task until it restarts (its GPUs are quarantined);
    one that asked because a device failed has that device withdrawn already and goes on
    with the devices that answer.
    """
    return why == "gpu-unhealthy"  # the reason its guard asks with


def grant(
    wanted: Sequence[str], owners: Mapping[str, str], *, share: bool
) -> tuple[list[str], dict[str, str]]:
    """The UUIDs of ``wanted`` a worker may drive, given the other workers' (``owners``:
    UUID -> worker), and the refused ones with their owners: one owner per GPU UUID
    unless ``share``.

    A MIG device is owned by its own ``MIG-`` UUID: two MIG devices of one GPU have two
    owners, and one MIG device named two ways (its UUID, its parent's index) has one.
    """
    refused = {} if share else {uuid: owners[uuid] for uuid in wanted if uuid in owners}
    return [uuid for uuid in wanted if uuid not in refused], refused
