"""Elastic GPU pools: how many workers each pool should have, and which ones go.

Decisions only, no distributed import. :func:`accelsched.adapt` feeds :func:`decide`
the pools (:class:`Pool`: each worker's devices, its minimum and maximum), what each has
now (:class:`PoolState`: workers running, starting, and how long each idle one has been
idle), the GPU work by class (:class:`GpuDemand`: a requirement and a device count, its
tasks waiting for a worker and running) and the CPU work; it answers with a
:class:`Plan`: a target per pool, the idle workers to retire (GPU pools' first: they are
the expensive ones), and for each waiting class the pool whose starting worker will
serve it or the pools at their maximum that could, which is what a GPU task's fallback
timer goes by (:func:`counted_from`).

Requirements are matched as the scheduler matches them (:meth:`Requirement.fits
<accelsched.policy.requirements.Requirement.fits>` on each device of a pool's worker): a
pool that says nothing of its devices serves only GPU tasks without a requirement.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence, Set
from dataclasses import dataclass, field

from accelsched.policy.requirements import DeviceFacts, Requirement
from accelsched.protocol import WorkerDemand

__all__ = [
    "Pool",
    "PoolState",
    "GpuDemand",
    "Plan",
    "decide",
    "workers_for",
    "counted_from",
    "still_retired",
    "to_close",
    "keep_a_receiver",
    "GPU_DEMAND",
    "CPU_DEMAND",
    "MINIMUM",
    "IDLE",
]

GPU_DEMAND = "gpu-demand"  # GPU tasks of a class this pool's devices serve wait or run
CPU_DEMAND = "cpu-demand"  # tasks without a GPU wait or run
MINIMUM = "minimum"  # the pool's minimum
IDLE = "idle"  # a worker had nothing to do for idle_after seconds


@dataclass(frozen=True)
class Pool:
    """One pool: what each of its workers has, and how many it may have."""

    name: str
    minimum: int = 0
    maximum: int = 1
    gpus: int = 0  # devices per worker; 0: a CPU pool
    devices: tuple[DeviceFacts, ...] = ()  # what each worker's devices are (empty: unsaid)
    threads: int = 1  # tasks a worker runs at once

    def slots(self, need: Requirement, devices: int) -> int:
        """How many tasks of a class one worker runs at once (0: it cannot serve it)."""
        if self.gpus < devices or devices < 1:
            return 0
        # devices a pool says nothing of meet no requirement
        usable = sum(need.fits(f) for f in self.devices) if need else self.gpus
        return min(self.threads, usable // devices)


@dataclass(frozen=True)
class PoolState:
    """A pool now: its workers that arrived, those starting, and the idle ones."""

    running: int = 0
    starting: int = 0
    idle: Mapping[str, float] = field(default_factory=dict)  # worker name -> seconds idle


@dataclass(frozen=True)
class GpuDemand:
    """GPU tasks of one class (requirement, devices each task takes)."""

    name: str  # the class, as the scheduler names it
    need: Requirement
    devices: int
    waiting: int  # no worker can take them now
    running: int = 0  # sent to a worker (running or queued there)
    seconds: float = 0.0  # their expected run time, summed


@dataclass
class Plan:
    """What :func:`decide` answers."""

    targets: dict[str, int]  # pool -> workers it should have
    reasons: dict[str, str]  # pool -> why its target (GPU_DEMAND, CPU_DEMAND, MINIMUM)
    retire: list[str]  # idle workers to retire, GPU pools' first
    coming: dict[str, str]  # waiting class -> the pool whose starting worker serves it
    full: dict[str, list[str]]  # waiting class -> pools at their maximum that could
    unserved: list[str]  # waiting classes no pool's devices can ever serve


def workers_for(tasks: int, seconds: float, slots: int, target_duration: float) -> int:
    """Workers for ``tasks`` of ``seconds`` expected work, ``slots`` at a time each.

    As distributed's adaptive target: enough to get through the work within
    ``target_duration``, never more than one per ``slots`` tasks, and one at least while a
    task is there.
    """
    if tasks <= 0 or slots <= 0:
        return 0
    by_count = math.ceil(tasks / slots)
    if target_duration <= 0:
        return by_count
    by_time = math.ceil(seconds / (target_duration * slots))
    return max(1, min(by_count, by_time))


def decide(
    pools: Sequence[Pool],
    states: Mapping[str, PoolState],
    gpu: Sequence[GpuDemand],
    *,
    cpu_tasks: int = 0,
    cpu_seconds: float = 0.0,
    target_duration: float = 5.0,
    idle_after: float = 60.0,
) -> Plan:
    """Targets per pool and the idle workers to retire.

    GPU work goes to the pools whose devices serve its class, in the order given, each up
    to its maximum, the rest to the next; CPU work to the CPU pools (``gpus == 0``) the
    same way. A pool above its target retires its workers idle for ``idle_after``
    seconds at least, the longest idle first; a busy or starting worker is never
    retired.
    """
    want = {p.name: 0 for p in pools}
    reasons: dict[str, str] = {}

    def spill(able: list[tuple[Pool, int]], tasks: int, seconds: float, reason: str) -> None:
        """Work to the pools of ``able`` (each with the tasks it runs at once), in order,
        each up to its maximum; what one cannot take goes to the next."""
        for p, slots in able:
            n = workers_for(tasks, seconds, slots, target_duration)
            take = min(n, p.maximum - want[p.name])
            if take > 0:
                want[p.name] += take
                reasons.setdefault(p.name, reason)
            if take >= n:
                return
            left = 1 - take / n
            tasks, seconds = math.ceil(tasks * left), seconds * left

    for d in sorted(gpu, key=lambda d: d.name):  # to the pools whose devices serve it
        able = [(p, n) for p in pools if (n := p.slots(d.need, d.devices))]
        spill(able, d.waiting + d.running, d.seconds, GPU_DEMAND)
    spill([(p, p.threads) for p in pools if p.gpus == 0], cpu_tasks, cpu_seconds, CPU_DEMAND)
    targets = {p.name: min(p.maximum, max(p.minimum, want[p.name])) for p in pools}
    below = {p.name: MINIMUM for p in pools if want[p.name] < p.minimum}  # demand says first
    plan = Plan(
        targets=targets,
        reasons={p: r for p, r in {**below, **reasons}.items() if targets[p] > 0},
        retire=[],
        coming={},
        full={},
        unserved=[],
    )
    # idle workers past idle_after of pools above their target, GPU pools' first
    for p in sorted(pools, key=lambda p: p.gpus == 0):  # stable: GPU pools first, in order
        now = states.get(p.name, PoolState())
        excess = now.running + now.starting - targets[p.name]
        idle = sorted(
            ((t, w) for w, t in now.idle.items() if t >= idle_after), key=lambda tw: -tw[0]
        )
        plan.retire += [w for _, w in idle[: max(0, excess)]]
    # for each class with waiting tasks: the pool whose starting worker will serve it (one
    # starting now, or started by this plan), else the pools at their maximum that could
    # serve it, else (no pool's devices can) unserved
    starting = {
        p.name
        for p in pools
        if (now := states.get(p.name, PoolState())).starting > 0
        or targets[p.name] > now.running + now.starting
    }
    # at its maximum: as many workers as it may have, running, starting or planned
    held = {p.name: (s := states.get(p.name, PoolState())).running + s.starting for p in pools}
    at_most = {p.name for p in pools if max(targets[p.name], held[p.name]) >= p.maximum}
    for d in (d for d in gpu if d.waiting > 0):
        serving = [p.name for p in pools if p.slots(d.need, d.devices) > 0]
        if not serving:
            plan.unserved.append(d.name)
        elif coming := [p for p in serving if p in starting]:
            plan.coming[d.name] = coming[0]
        elif at_maximum := [p for p in serving if p in at_most]:
            # (a pool below its maximum serves it with the workers it runs: not full)
            plan.full[d.name] = at_maximum
    return plan


def counted_from(since: float, coming_until: float | None, bound: float) -> float:
    """When a waiting GPU task's fallback timeout starts to count.

    ``since``: when it became unrunnable; ``coming_until``: until when a worker that can
    serve it was said to be starting (None: none was). Its timeout counts from when no
    such worker is coming, at most ``bound`` seconds after ``since``: a pool that keeps
    starting workers that never arrive cannot hold a task back for ever.
    """
    if coming_until is None or coming_until <= since:
        return since
    return min(coming_until, since + bound)


# --- retired workers: which are still retired, which to close, which may retire together ---


def still_retired(
    before: Set[str], members: Iterable[str], seen: Mapping[str, WorkerDemand]
) -> set[str]:
    """The pools' retired workers at this look: the ``members`` the scheduler says
    retire (``seen``; another controller's too), and those retired ``before`` it no
    longer lists (they left). One it lists back in service is a member again."""
    return {n for n in members if (seen[n]["retiring"] if n in seen else n in before)}


def to_close(
    retired: Set[str], seen: Mapping[str, WorkerDemand], retry_at: Mapping[str, float], now: float
) -> list[str]:
    """The retired workers to close now: those the scheduler said, at this look, retire
    and run nothing (one retired since waits for the next look: what it ran then is not
    known), and those it no longer lists; none before its ``retry_at``."""
    return sorted(
        w
        for w in retired
        if retry_at.get(w, -math.inf) <= now
        and (w not in seen or (seen[w]["retiring"] and not seen[w]["busy"]))
    )


def keep_a_receiver(firm: Sequence[str], seen: Mapping[str, WorkerDemand]) -> list[str]:
    """Of the workers to retire together, those that can be: they cannot take each
    other's results, so with holders among them and no other worker running, the last
    proposed stays (it takes theirs; the cheapest: GPU pools' workers are proposed first)."""
    holders = [w for w in firm if w in seen and seen[w]["holds"]]
    if not holders or {n for n, w in seen.items() if w["running"]} - set(firm):
        return list(firm)
    return list(firm[:-1])
