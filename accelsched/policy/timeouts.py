"""When a GPU task stops waiting for a GPU: decisions only, no distributed import.

A GPU task that no worker can take sits in distributed's ``no-worker`` state forever.
With a fallback timeout it runs its CPU form instead. The PlacementPlugin feeds
:func:`sweep` each unrunnable GPU task that is due (:class:`Waiting`: its wait, its
timeout, :func:`task_timeout`) and the cluster's GPU capacity; it answers with
``fall-back`` proposals (:class:`~accelsched.policy.proposals.Proposal`), which it
carries out.

Plain distributed leaves a task no worker can take in ``no-worker`` without a word ("it
will hang indefinitely"). accelsched says it: a GPU task unplaced for
:data:`NOTICE_AFTER` seconds is counted under the reason no worker takes it
(:func:`reason_for`), the count is in ``accelsched status`` and on the dashboard, and a
``gpu-waiting`` event is written once per reason (:class:`Notices`): again only after
that reason had no task waiting.
"""

from __future__ import annotations

import functools
import heapq
import itertools
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from accelsched.config import parse_optional_duration
from accelsched.policy.marks import Mark
from accelsched.policy.proposals import Proposal
from accelsched.protocol import TIMEOUT_ANNOTATION

__all__ = [
    "task_timeout",
    "Waiting",
    "deadline",
    "sweep",
    "TIMEOUT",
    "NO_GPU_CAPACITY",
    "UNSATISFIABLE",
    "MAX_GPUS",
    "DUAL_TIMEOUT",
    "CHAIN",
    "OOM",
    "parse_task_timeout",
    "Deadlines",
    "summarise",
    "NOTICE_AFTER",
    "NO_GPU",
    "TOO_FEW_GPUS",
    "UNMET_REQUIREMENT",
    "NO_ELIGIBLE_WORKER",
    "REASONS",
    "reason_for",
    "Notices",
]

TIMEOUT = "timeout"  # the task's own timeout expired
NO_GPU_CAPACITY = "no-gpu-capacity"  # timeout 0: no GPU worker can take it now
UNSATISFIABLE = "unsatisfiable"  # asks for more GPUs than any worker can ever have
CHAIN = "chain"  # a GPU predecessor fell back and there is still no GPU capacity
OOM = "oom"  # the GPU form ran out of device memory (decided on the worker)

#: Seconds a ``dual`` step waits unplaced before its CPU form runs, where neither the
#: task, the step nor the plugin says otherwise: it has a CPU form, so waiting for ever
#: on a cluster without a GPU that can take it would only hide that. Long enough for a
#: GPU worker to start or restart; ``dual(..., fallback_timeout=None)`` keeps it strict.
DUAL_TIMEOUT = 30.0


@functools.lru_cache(maxsize=256, typed=True)
def _parse(value: Any) -> float | None:
    try:
        return parse_optional_duration("fallback_timeout annotation", value)
    except TypeError as exc:
        raise ValueError(str(exc)) from None


def parse_task_timeout(value: Any) -> float | None:
    """Parse a ``fallback_timeout`` task annotation; ValueError names the bad value.

    A graph carries the same few values on thousands of tasks: parsed once each.
    """
    try:
        return _parse(value)
    except TypeError:  # unhashable: parse it to get the error naming it
        return _parse.__wrapped__(value)


#: The most GPUs one worker can offer: far above any host NVML can show (8 GPUs of 7 MIG
#: instances each is 56). A task asking for more can never be placed, however long it
#: waits, and its amount may not even be sendable to a worker (msgpack stops at 2**64).
MAX_GPUS = 65536


def task_timeout(
    default: float | None, annotations: Mapping[str, Any], mark: Mark | None = None
) -> float | None:
    """The timeout a task lives by: its ``fallback_timeout`` annotation (parsed;
    ValueError names a bad one), else the marked step's own, else a ``dual`` step's
    CPU-form timeout where the plugin has no ``default`` (None: strict, never fall back),
    else the default."""
    if TIMEOUT_ANNOTATION in annotations:
        return parse_task_timeout(annotations[TIMEOUT_ANNOTATION])
    if mark is not None and mark.timeout_given:
        return mark.timeout
    if mark is not None and mark.cpu_form is not None and default is None:
        return mark.cpu_form  # it has a CPU form: waiting for ever would only hide that
    return default


@dataclass(frozen=True)
class Waiting:
    """One unrunnable GPU task, as the scheduler sees it at a check."""

    key: Hashable
    since: float  # when it became unrunnable (same clock as ``now``)
    amount: float  # GPUs it asks for
    timeout: float | None  # its timeout (annotation or default); None: strict
    predecessor_fell_back: bool = False


def deadline(w: Waiting) -> float | None:
    """When a check first looks at ``w``, which just became unrunnable (None: never, it is
    strict): at once when waiting cannot help (it asks for more GPUs than any worker can
    ever offer) or may not (a predecessor fell back: :data:`CHAIN`); else when its own
    timeout passes, as for a task looked at and kept waiting (:func:`sweep`)."""
    if w.timeout is None:
        return None
    if w.predecessor_fell_back or w.amount > MAX_GPUS:
        return w.since
    return w.since + w.timeout


def sweep(
    waiting: Iterable[Waiting], *, now: float, largest: float
) -> tuple[list[Proposal], dict[Hashable, float]]:
    """Decide for every waiting task; ``largest`` is the most GPUs one worker offers now.

    Returns one ``fall-back`` proposal per task to run in its CPU form now (reason: why;
    figures: ``waited``, seconds), and when to look again at each task kept waiting that
    has a timeout (its own timeout's end), for the caller to look again then. A strict
    task (no timeout) never falls back; one that asks for more than :data:`MAX_GPUS`
    falls back at once (:data:`UNSATISFIABLE`); one whose predecessor fell back, at once
    while no worker has the GPUs it needs (:data:`CHAIN`); a zero timeout, at once
    (:data:`NO_GPU_CAPACITY`: it is unplaced now); else at its timeout (:data:`TIMEOUT`).
    """
    proposals: list[Proposal] = []
    later: dict[Hashable, float] = {}
    for w in waiting:
        if w.timeout is None:
            continue
        waited = now - w.since
        if w.amount > MAX_GPUS:
            reason = UNSATISFIABLE
        elif w.predecessor_fell_back and largest < w.amount:
            reason = CHAIN
        elif w.timeout == 0:
            reason = NO_GPU_CAPACITY
        elif waited >= w.timeout:
            reason = TIMEOUT
        else:
            later[w.key] = w.since + w.timeout
            continue
        proposals.append(Proposal("fall-back", w.key, reason, {"waited": waited}))
    return proposals, later


class Deadlines:
    """The times the fallback check looks at waiting GPU tasks, earliest first.

    A check costs what is due, not what waits: a task enters when it becomes unrunnable
    (with its :func:`deadline`), and a check pops only the entries whose deadline passed,
    O(k log n) for k due of n waiting. The task's own record says whether an entry still
    counts (``live(key, deadline)``: it left ``no-worker``, or entered again, since), so
    nothing here is kept per task; tasks without a timeout never enter.
    """

    def __init__(self, live: Callable[[Hashable, float], bool]) -> None:
        self._heap: list[tuple[float, int, Hashable]] = []
        self._live = live
        self._ids = itertools.count()

    def add(self, key: Hashable, deadline: float) -> None:
        heapq.heappush(self._heap, (deadline, next(self._ids), key))

    def next_deadline(self) -> float | None:
        """The earliest deadline that still counts (drops stale entries on top)."""
        heap = self._heap
        while heap and not self._live(heap[0][2], heap[0][0]):
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def pop_due(self, now: float) -> list[Hashable]:
        """Remove and return the keys whose deadline passed at ``now`` (live entries)."""
        due = []
        heap = self._heap
        while heap and heap[0][0] <= now:
            at, _, key = heapq.heappop(heap)
            if self._live(key, at):
                due.append(key)
        if len(heap) > 64:  # stale entries outnumbering live ones go: memory stays O(waiting)
            live = [e for e in heap if self._live(e[2], e[0])]
            if 4 * len(live) < len(heap):
                self._heap = live
                heapq.heapify(live)
        return due


def summarise(fell: Sequence[Proposal], detail: int) -> list[dict[str, Any]]:
    """The ``fallback`` events for one check's ``fall-back`` proposals: one per task up to
    ``detail`` tasks, else one for the whole burst (its size, a sample of keys, the
    reasons counted, waits).

    A burst of thousands of fallbacks (a cluster that lost its GPUs) then costs one log
    line and one event, not thousands.
    """
    if len(fell) <= detail:
        return [
            {
                "key": p.subject,
                "waited": round(p.figures["waited"], 3),
                "reason": p.reason,
                "count": 1,
            }
            for p in fell
        ]
    reasons = Counter(p.reason for p in fell)
    waits = sorted(p.figures["waited"] for p in fell)
    return [
        {
            "count": len(fell),
            "keys": [p.subject for p in fell[:detail]],
            "reason": reasons.most_common(1)[0][0],
            "reasons": dict(reasons),
            "waited": round(waits[len(waits) // 2], 3),
            "waited_max": round(waits[-1], 3),
        }
    ]


#: Seconds a GPU task waits unplaced before it is counted and said: a task submitted
#: while its worker is still being verified is placed well within this.
NOTICE_AFTER = 2.0

NO_GPU = "no-verified-gpu"  # no worker in the cluster offers a verified GPU
TOO_FEW_GPUS = "too-few-gpus"  # it needs more GPUs than any one worker offers
UNMET_REQUIREMENT = "unmet-requirement"  # no verified device meets what it asks of one
NO_ELIGIBLE_WORKER = "no-eligible-worker"  # GPUs enough, not on a worker it may run on

#: What each reason means, for people (``accelsched status``, the event's text).
REASONS = {
    NO_GPU: "no worker has a verified GPU",
    TOO_FEW_GPUS: "no worker has as many verified GPUs as they need",
    UNMET_REQUIREMENT: "no verified device meets their requirement",
    NO_ELIGIBLE_WORKER: (
        "the workers they may run on offer them no verified GPU, or not the room they declare"
    ),
}


def reason_for(amount: float, largest: float, unmet: bool) -> str:
    """Why a GPU task needing ``amount`` GPUs is unplaced, ``largest`` being the most any
    one worker offers now; ``unmet``: no worker in the cluster has verified devices
    meeting what it asks of them, as many as it needs (one that some worker meets waits
    for the workers it may run on, or for room there)."""
    if largest <= 0:
        return NO_GPU
    if unmet:
        return UNMET_REQUIREMENT
    if amount > largest:
        return TOO_FEW_GPUS
    return NO_ELIGIBLE_WORKER


class Notices:
    """Which reasons to say now: each once, again only after it had no task waiting."""

    def __init__(self) -> None:
        self.said: set[str] = set()

    def update(self, waiting: Iterable[str]) -> list[str]:
        """``waiting``: the reasons with tasks waiting now; returns those to say."""
        now = set(waiting)
        new = sorted(now - self.said)
        self.said = now
        return new
