"""When a GPU task stops waiting for a GPU: decisions only, no distributed import.

A GPU task that no worker can take sits in distributed's ``no-worker`` state forever.
With a fallback timeout it runs its CPU form instead. The PlacementPlugin feeds
:class:`FallbackPolicy` each unrunnable GPU task's wait and the cluster's GPU capacity;
the policy answers with the reason to fall back, or None to keep waiting. :func:`sweep`
turns one check's answers into ``fall-back`` proposals
(:class:`~accelsched.policy.proposals.Proposal`), which the scheduler's actor carries out.

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
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from accelsched.config import parse_optional_duration
from accelsched.policy.marks import Mark
from accelsched.policy.proposals import Proposal

__all__ = [
    "FallbackPolicy",
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

_UNSET: Any = object()


def parse_task_timeout(value: Any) -> float | None:
    """Parse a ``fallback_timeout`` task annotation; ValueError names the bad value.

    A graph carries the same few values on thousands of tasks: parsed once each.
    """
    try:
        return _parse_cached(value)
    except TypeError:  # unhashable: parse it to get the error naming it
        return _parse(value)


def _parse(value: Any) -> float | None:
    try:
        return parse_optional_duration("fallback_timeout annotation", value)
    except TypeError as exc:
        raise ValueError(str(exc)) from None


_parse_cached = functools.lru_cache(maxsize=256, typed=True)(_parse)


#: The most GPUs one worker can offer: far above any host NVML can show (8 GPUs of 7 MIG
#: instances each is 56). A task asking for more can never be placed, however long it
#: waits, and its amount may not even be sendable to a worker (msgpack stops at 2**64).
MAX_GPUS = 65536


class FallbackPolicy:
    """Decides, per unrunnable GPU task, how long it waits and whether to run its CPU form now.

    ``default`` is the plugin-wide timeout in seconds (None: strict, never fall back).
    """

    def __init__(self, default: float | None) -> None:
        self.default = default

    def timeout(self, annotated: Any = _UNSET, mark: Mark | None = None) -> float | None:
        """The timeout a task lives by: its ``fallback_timeout`` annotation (parsed;
        ValueError names a bad one), else the marked step's own, else a ``dual`` step's
        CPU-form timeout where the plugin has no default, else the default."""
        if annotated is not _UNSET:
            return parse_task_timeout(annotated)
        if mark is not None and mark.timeout_given:
            return mark.timeout
        if mark is not None and mark.cpu_form is not None and self.default is None:
            return mark.cpu_form  # it has a CPU form: waiting for ever would only hide that
        return self.default

    def decide(
        self,
        *,
        waited: float,
        timeout: float | None,
        predecessor_fell_back: bool,
        gpu_capacity: bool,
        can_ever: bool = True,
    ) -> str | None:
        """Reason to fall back now, or None to keep waiting.

        ``waited``: seconds the task has been unrunnable. ``gpu_capacity``: whether any
        worker in the cluster has enough verified GPUs for it right now. ``can_ever``:
        whether any worker could ever (at most :data:`MAX_GPUS`); if not, waiting is pointless.
        """
        if timeout is None:
            return None
        if not can_ever:
            return UNSATISFIABLE
        if predecessor_fell_back and not gpu_capacity:
            return CHAIN
        if timeout == 0:
            return NO_GPU_CAPACITY
        if waited >= timeout:
            return TIMEOUT
        return None


@dataclass(frozen=True)
class Waiting:
    """One unrunnable GPU task, as the scheduler sees it at a check."""

    key: Hashable
    since: float  # when it became unrunnable (same clock as ``now``)
    amount: float  # GPUs it asks for
    timeout: float | None  # its timeout (annotation or default); None: strict
    predecessor_fell_back: bool = False


def deadline(w: Waiting, *, looked: bool = False) -> float | None:
    """When the policy looks at ``w`` (None: never, it is strict): the one deadline rule.

    A task that just became unrunnable is looked at once when waiting cannot help (it
    asks for more GPUs than any worker can ever offer) or may not (a predecessor fell
    back: :data:`CHAIN`); else, and once looked at and kept waiting (``looked``), when
    its own timeout passes.
    """
    if w.timeout is None:
        return None
    if not looked and (w.predecessor_fell_back or w.amount > MAX_GPUS):
        return w.since
    return w.since + w.timeout


def sweep(
    policy: FallbackPolicy, waiting: Iterable[Waiting], *, now: float, largest: float
) -> tuple[list[Proposal], dict[Hashable, float]]:
    """Decide for every waiting task; ``largest`` is the most GPUs one worker offers now.

    Returns one ``fall-back`` proposal per task to run in its CPU form now (reason: why;
    figures: ``waited``, seconds), and the deadline (:func:`deadline`) of each task kept
    waiting that has one, for the caller to look again then.
    """
    proposals: list[Proposal] = []
    later: dict[Hashable, float] = {}
    for w in waiting:
        waited = now - w.since
        reason = policy.decide(
            waited=waited,
            timeout=w.timeout,
            predecessor_fell_back=w.predecessor_fell_back,
            gpu_capacity=largest >= w.amount,
            can_ever=w.amount <= MAX_GPUS,
        )
        if reason is not None:
            proposals.append(Proposal("fall-back", w.key, reason, {"waited": waited}))
        elif (at := deadline(w, looked=True)) is not None:
            later[w.key] = at
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
    NO_ELIGIBLE_WORKER: "the workers they may run on offer them no verified GPU",
}


def reason_for(amount: float, largest: float, requirement: bool) -> str:
    """Why a GPU task needing ``amount`` GPUs is unplaced, ``largest`` being the most any
    one worker offers now; ``requirement``: it asks something of its device."""
    if largest <= 0:
        return NO_GPU
    if requirement:
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
