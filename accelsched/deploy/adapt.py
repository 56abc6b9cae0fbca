"""``accelsched.adapt``: elastic GPU pools on any ``SpecCluster``.

distributed's ``Adaptive`` sizes one pool by task durations and knows nothing of
resources. :class:`ElasticPools` is an ``Adaptive`` (its periodic loop, its ``interval``,
``wait_count`` and ``target_duration``; it retires as ``Adaptive.scale_down`` does, through
the scheduler's ``retire_workers``, which moves a worker's data to peers before it closes,
and closes only the workers that retired), sizing *named*
pools: each a worker spec, a minimum and a maximum, and what each of its workers' devices
are. Every interval it asks the scheduler what waits (``accelsched_demand``), asks
:func:`accelsched.policy.scaling.decide` what to do, adds workers to
``cluster.worker_spec`` (named ``<pool>-<n>``, the lowest free ``n``) and lets the
cluster start them (``SpecCluster.scale`` at its own size), retires idle ones, and tells
the scheduler which waiting classes a starting worker will serve (``accelsched_pools``),
so their fallback timers wait for it, within ``start_timeout``.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import logging
import math
import re
from collections import defaultdict
from collections.abc import Mapping
from typing import Any, NamedTuple, cast

from distributed import Adaptive, SpecCluster
from distributed.metrics import time

from accelsched import events, internals
from accelsched.config import ADAPT_OPTIONS, resolve_options
from accelsched.internals.client_side import (
    cluster_holds,
    correct,
    lost_worker_timeout,
    retire_named,
    spec_class,
    start_failed,
    take_adaptive,
)
from accelsched.policy.requirements import DeviceFacts, parse_requirement
from accelsched.policy.scaling import (
    GpuDemand,
    Plan,
    Pool,
    PoolState,
    decide,
    keep_a_receiver,
    still_retired,
    to_close,
)
from accelsched.protocol import (
    DEMAND_HANDLER,
    GPU,
    INT_LIMIT,
    POOLS_HANDLER,
    DemandReply,
    WorkerDemand,
    placement_served,
)

__all__ = ["adapt", "ElasticPools", "parse_pools", "PoolSpec"]

logger = logging.getLogger(__name__)

POOL_KEYS = ("spec", "minimum", "maximum", "devices")
DEVICE_KEYS = ("count", "name", "memory", "capability", "mig")
#: Longest wait (seconds) before trying again: moving a retired worker's results no peer
#: took, starting a pool's worker after one failed to start.
RETRY_WAIT_MAX = 60.0
#: A pool's name: its workers are ``<name>-<n>``.
_NAME = re.compile(r"[A-Za-z0-9_.]{1,64}")  # (whole: fullmatch, no newline after it)


class PoolSpec(NamedTuple):
    """A pool as given, checked: the decision's view and the worker spec to start."""

    pool: Pool
    spec: dict[str, Any]


def _count(pool: str, key: str, value: Any, least: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not least <= value < INT_LIMIT:
        raise ValueError(
            f"pool {pool!r}: invalid {key}={value!r}: expected an integer >= {least} "
            f"and under {INT_LIMIT}"
        )
    return value


def _known(pool: str, what: str, given: Mapping[str, Any], keys: tuple[str, ...]) -> None:
    if unknown := sorted(map(repr, set(given) - set(keys))):
        raise ValueError(
            f"pool {pool!r}: unknown {what} {', '.join(unknown)}: expected {', '.join(keys)}"
        )


def _devices(pool: str, given: Any, declared: Any) -> tuple[int, tuple[DeviceFacts, ...]]:
    """(devices per worker, their facts) from a pool's ``devices`` and its spec's
    declared ``resources={"GPU": n}``."""
    if given is None:
        return (_count(pool, "resources['GPU']", declared) if declared is not None else 0), ()
    if not isinstance(given, Mapping):
        raise TypeError(f"pool {pool!r}: invalid devices={given!r}: expected a mapping")
    _known(pool, "devices key(s)", given, DEVICE_KEYS)
    count = _count(pool, "devices count", given.get("count", 1), least=1)
    if declared is not None and declared != count:
        raise ValueError(
            f"pool {pool!r}: devices count={count} but its workers declare "
            f"resources={{'GPU': {declared!r}}}"
        )
    try:  # read as a requirement reads them: the same parsers, the same errors
        need = parse_requirement({k: given.get(k) for k in ("memory", "capability", "mig")})
    except (ValueError, TypeError) as exc:
        raise ValueError(f"pool {pool!r}: invalid devices: {exc}") from None
    name = given.get("name", "")
    if not isinstance(name, str):
        raise TypeError(f"pool {pool!r}: invalid devices name={name!r}: expected a string")
    return count, (DeviceFacts(name, need.memory or 0, need.capability, bool(need.mig)),) * count


def _declared_gpus(pool: str, options: Mapping[str, Any]) -> Any:
    """The GPUs a pool's workers declare: a worker's ``resources={"GPU": n}``, or a
    dask-jobqueue job's ``worker_extra_args=["--resources", "GPU=n"]`` (None: none said)."""
    if "resources" in options:
        resources = options["resources"] or {}
        if not isinstance(resources, Mapping):
            raise TypeError(
                f"pool {pool!r}: invalid spec options resources={resources!r:.80}: expected "
                "a mapping, like {'GPU': 1}"
            )
        return resources.get(GPU)
    args = options.get("worker_extra_args") or ()
    if not isinstance(args, (list, tuple)):
        raise TypeError(
            f"pool {pool!r}: invalid spec options worker_extra_args={args!r:.80}: expected a "
            "list of arguments, like ['--resources', 'GPU=1']"
        )
    # "--resources GPU=1", or one argument "--resources=GPU=1" (click takes both)
    args = [
        part
        for a in args
        for part in (str(a).split("=", 1) if str(a).startswith("--resources=") else (a,))
    ]
    for flag, value in zip(args, args[1:], strict=False):
        if flag == "--resources":
            for item in str(value).replace(",", " ").split():
                key, _, amount = item.partition("=")
                if key == GPU:
                    try:
                        return int(amount)
                    except ValueError:
                        raise ValueError(
                            f"pool {pool!r}: invalid --resources {value!r}: expected GPU=<n>"
                        ) from None
    return None


def parse_pools(pools: Any) -> dict[str, PoolSpec]:
    """Check ``pools`` (``{name: {"spec": ..., "minimum": 0, "maximum": n, "devices":
    {...}}}``); ``ValueError``/``TypeError`` name the pool and the bad key or value."""
    if not isinstance(pools, Mapping) or not pools:
        raise TypeError(f"invalid pools={pools!r:.80}: expected a non-empty mapping of pools")
    out: dict[str, PoolSpec] = {}
    for name, given in pools.items():
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ValueError(
                f"invalid pool name {name!r}: expected letters, digits, '_' or '.' "
                "(its workers are named '<pool>-<n>')"
            )
        if not isinstance(given, Mapping):
            raise TypeError(f"pool {name!r}: expected a mapping of {', '.join(POOL_KEYS)}")
        _known(name, "key(s)", given, POOL_KEYS)
        spec = given.get("spec")
        if not isinstance(spec, Mapping) or "cls" not in spec or set(spec) - {"cls", "options"}:
            raise ValueError(
                f"pool {name!r}: invalid spec={spec!r:.80}: expected "
                "{'cls': a worker class, 'options': {...}} as SpecCluster takes"
            )
        # the class now, as ``SpecCluster`` takes it (a class, or its import path as a
        # string), not when the first worker of the pool is wanted
        try:
            cls = spec_class(spec["cls"])
        except (ImportError, AttributeError, ValueError) as exc:
            raise ValueError(f"pool {name!r}: invalid spec cls={spec['cls']!r}: {exc}") from None
        if not internals.worker_class(cls):
            raise TypeError(
                f"pool {name!r}: invalid spec cls={spec['cls']!r:.80}: expected a worker class "
                "(Nanny, Worker, a dask-jobqueue job class) or its import path"
            )
        options = spec.get("options") or {}
        if not isinstance(options, Mapping):
            raise TypeError(f"pool {name!r}: invalid spec options={options!r:.80}")
        if "name" in options:
            raise ValueError(f"pool {name!r}: its workers are named '{name}-<n>': no 'name'")
        minimum = _count(name, "minimum", given.get("minimum", 0))
        maximum = _count(name, "maximum", given.get("maximum", 1))
        if minimum > maximum:
            raise ValueError(f"pool {name!r}: minimum={minimum} > maximum={maximum}")
        gpus, facts = _devices(name, given.get("devices"), _declared_gpus(name, options))
        if (processes := options.get("processes")) not in (None, 1):
            raise ValueError(
                f"pool {name!r}: invalid spec options processes={processes!r}: a pool's job "
                "runs one worker, named '<pool>-<n>'"
            )
        if processes is None and getattr(cls, "config_name", None) is not None:
            # a dask-jobqueue job not told splits its cores into several workers (its
            # config's processes, else about their square root), named '<pool>-<n>-<i>':
            # never seen as the pool's, they would count as starting for ever
            options = {**options, "processes": 1}
        # tasks a worker runs at once: its ``nthreads``, or a dask-jobqueue job's ``cores``
        # (one worker per job: a job of several workers names them ``<name>-<i>``, which
        # are not the pool's ``<pool>-<n>``)
        if options.get("cores") is not None and not options.get("nthreads"):
            threads = _count(name, "spec options cores", options["cores"], least=1)
        else:  # 0 or None: every core, as distributed reads them (here: their host's may differ)
            given_threads = options.get("nthreads") or internals.cpu_count()
            threads = _count(name, "spec options nthreads", given_threads, least=1)
        out[name] = PoolSpec(
            Pool(name, minimum, maximum, gpus, facts, threads),
            {"cls": spec["cls"], "options": dict(options)},
        )
    return out


class ElasticPools(Adaptive):
    """Named pools on a ``SpecCluster``, sized by accelsched's demand (see the module)."""

    state = "inactive"  # until Adaptive starts it: refused options leave nothing to stop
    cluster: SpecCluster  # (Adaptive keeps it)

    def __init__(self, cluster: SpecCluster, pools: Any, **options: Any) -> None:
        if not isinstance(cluster, SpecCluster):
            raise TypeError(
                f"accelsched.adapt needs a SpecCluster (LocalCluster, dask-jobqueue, ...), "
                f"got {type(cluster).__name__}"
            )
        self.options = resolve_options(ADAPT_OPTIONS, options, "accelsched.adapt")
        self.pools = parse_pools(pools)
        # each pool's class, built so that one raising as it is built fails its worker
        # alone (SpecCluster builds all new workers in one loop)
        self._build = {n: internals.built_or_failed(s["cls"]) for n, (_, s) in self.pools.items()}
        self._idle_since: dict[str, float] = {}  # worker -> since when it has had no task
        #: GPU pool workers seen with verified GPUs, or said to have none (once each)
        self._verified: set[str] = set()
        self._said_deviceless: set[str] = set()
        self._started: dict[str, float] = {}  # worker -> when this asked for it
        self.last_plan: Plan | None = None
        #: whether the scheduler ran a PlacementPlugin at the last look (None: not asked
        #: yet): the warning is said once, as it goes missing
        self._served: bool | None = None
        #: pool -> when its latest worker still starting was asked for (at the last look)
        self._awaited: dict[str, float] = {}
        #: the pools' retired workers that still run (as the scheduler said at the last
        #: look, so one another controller retired is known too): closed once idle
        self._closing: set[str] = set()
        #: the workers' names the scheduler listed at the last look
        self._listed: set[str] = set()
        #: worker name -> when the scheduler stopped listing it (within the cluster's
        #: lost-worker-timeout: see :meth:`_see`)
        self._left: dict[str, float] = {}
        #: retired worker whose results no peer took -> (when to try again, the wait)
        self._retry: dict[str, tuple[float, float]] = {}
        #: the cluster closing retired workers -> their names (kept until done: asyncio
        #: holds tasks weakly; a name is free again only after)
        self._closes: dict[asyncio.Future[None], list[str]] = {}
        #: pool -> (when it may ask for a worker again, the wait, when that wait began)
        #: after one of its workers failed to start
        self._held_back: dict[str, tuple[float, float, float]] = {}
        #: members the cluster held a worker object for at the last look
        self._held: set[str] = set()
        #: a GPU pool's worker running only CPU tasks is idle (they can go to a CPU pool)
        self._gpu_idle_with_cpu_work = any(not pool.gpus for pool, _ in self.pools.values())
        super().__init__(
            cluster,
            interval=self.options["interval"],
            minimum=0,
            maximum=math.inf,
            wait_count=self.options["wait_count"],
            target_duration=self.options["target_duration"],
        )
        if (previous := take_adaptive(cluster, self)) is not None:
            logger.warning(
                "accelsched.adapt: stopped the cluster's earlier adaptive controller (%s): "
                "one sizes a cluster at a time",
                type(previous).__name__,
            )

    def members(self, pool: str) -> list[str]:
        """The workers of ``pool`` the cluster has now (starting or running; not those
        retired, finishing what they run)."""
        return [n for n in self._named(pool) if n not in self._closing]

    def _named(self, pool: str) -> list[str]:
        prefix = pool + "-"
        return [
            n
            for n in self.cluster.worker_spec
            if isinstance(n, str) and n.startswith(prefix) and n[len(prefix) :].isdigit()
        ]

    async def adapt(self) -> None:
        """One look: demand, decision, scale up, say what is coming, retire."""
        if self._adapting:  # as Adaptive: never two at once
            return
        self._adapting = True
        try:
            # its metadata first, at every look: a request to a handler the scheduler lacks
            # is logged there with a traceback (the plugin may be unregistered any time)
            reply: DemandReply | None = None
            if await placement_served(self.scheduler) is not False:
                reply = await getattr(self.scheduler, DEMAND_HANDLER)()
            if reply is None:  # None: distributed's answer to an operation it has no handler for
                if self._served is not False:  # said once, as the plugin goes missing
                    logger.warning(
                        "accelsched.adapt: the scheduler does not answer %s: it runs no "
                        "accelsched PlacementPlugin; register it (accelsched.register(client)) "
                        "or start the scheduler with --preload accelsched. The pools wait",
                        DEMAND_HANDLER,
                    )
                self._served = False
                return
            self._served = True
            now = time()
            listed = {w["name"]: w for w in reply["workers"]}
            self._see(listed, now)
            # the pools' retired workers: those the scheduler says retire (another
            # controller's too), and those retired before that it no longer lists (they
            # left: closed below); one it lists back in service is a member again
            named = [n for pool in self.pools for n in self._named(pool)]
            self._closing = still_retired(self._closing, named, listed)
            self._replace_failed(listed, now)
            self.last_plan = plan = decide(
                [pool for pool, _ in self.pools.values()],
                self._states(listed, now),
                [
                    GpuDemand(
                        d["name"],
                        parse_requirement(d["requirement"]),
                        d["devices"],
                        d["waiting"],
                        d["running"],
                        d["seconds"],
                    )
                    for d in reply["gpu"]
                ],
                cpu_tasks=reply["cpu_tasks"],
                cpu_seconds=reply["cpu_seconds"],
                target_duration=self.target_duration,
                idle_after=self.options["idle_after"],
            )
            await self._scale_up(plan, now)
            bound = self.options["start_timeout"]
            coming = {
                cls: left
                for cls, pool in plan.coming.items()
                if (left := self._awaited[pool] + bound - now) > 0
            }
            await getattr(self.scheduler, POOLS_HANDLER)(
                coming=coming, full=plan.full, bound=bound, pools=list(self.pools)
            )
            # retire the workers the plan proposed ``wait_count`` looks in a row
            # (by worker name in Adaptive's counts; one not proposed now starts again)
            counts = {w: cast(Any, self.close_counts)[w] + 1 for w in plan.retire}
            firm = [w for w, n in counts.items() if n >= self.wait_count]
            self.close_counts = cast(
                Any, defaultdict(int, {w: n for w, n in counts.items() if n < self.wait_count})
            )
            if firm := keep_a_receiver(firm, listed):
                # data moved to peers first; a worker whose data no peer could take stays
                retired = await retire_named(self.scheduler, firm)
                for pool in self.pools:
                    if workers := [w for w in firm if w in retired and w.startswith(pool + "-")]:
                        await self._event(
                            events.SCALE_DOWN,
                            pool=pool,
                            workers=workers,
                            reason="idle",
                            target=plan.targets[pool],
                        )
                self._closing.update(retired)
            await self._close_retired(listed, now)
        finally:
            self._adapting = False

    async def _close_retired(self, listed: Mapping[str, WorkerDemand], now: float) -> None:
        """Close the retired workers that run nothing now. A retired worker takes no new
        task (distributed's graceful closing) but finishes those it runs (CPU tasks a GPU
        pool's worker ran): their results are moved to a peer first (retired again), so
        closing it loses no work and runs nothing twice. One whose results no peer can
        take keeps them, and is tried again after a wait that doubles. Only what the
        scheduler said at this look counts: one retired since waits for the next look; one
        it no longer lists left, and only its spec goes."""
        self._retry = {w: r for w, r in self._retry.items() if w in self._closing}
        done = to_close(self._closing, listed, {w: at for w, (at, _) in self._retry.items()}, now)
        present = [w for w in done if w in listed]
        moved: set[str] = set()
        if present:
            try:
                moved = await retire_named(self.scheduler, present, close=True)
            except Exception as exc:  # the scheduler's connection, say: tried again later
                logger.warning("accelsched.adapt: could not retire %s again: %r", present, exc)
            for w in present:
                if w not in moved:
                    last = self._retry.get(w, (0.0, self.options["interval"]))[1]
                    wait = min(RETRY_WAIT_MAX, 2 * last)
                    self._retry[w] = (now + wait, wait)
        if closed := [w for w in done if w not in listed or w in moved]:
            # their times went at the look that first saw them retired (a retired worker
            # is no member)
            self._drop(closed)
            self._closing.difference_update(closed)

    def _drop(self, names: list[str]) -> None:
        """Drop the specs of ``names`` now, so no correction of the cluster starts them
        again, and let the cluster close their workers. Not awaited: its correction waits
        for every worker it is starting (a cloud VM, a loaded host: minutes), and no look
        would run meanwhile; their names are taken by no new worker until it is done."""
        for name in names:
            self.cluster.worker_spec.pop(name, None)
        task = asyncio.ensure_future(self._scale_down(names))
        self._closes[task] = names
        task.add_done_callback(self._closes.pop)

    async def _scale_down(self, names: list[str]) -> None:
        try:
            await self.cluster.scale_down(names)
        except Exception as exc:  # any worker's it starts; the next look sees who is there
            logger.warning(
                "accelsched.adapt: the cluster, correcting its workers after closing %s: %r",
                names,
                exc,
            )

    def _see(self, listed: Mapping[str, Any], now: float) -> None:
        """The workers the scheduler lists at this look. A name it stopped listing is
        given to no new worker for the cluster's ``lost-worker-timeout``: the cluster
        then closes whatever worker object it holds under that name, which would be the
        new one if it had not connected yet (a queued job, cancelled)."""
        bound = lost_worker_timeout()
        self._left = {w: t for w, t in self._left.items() if now - t < bound and w not in listed}
        self._left.update(dict.fromkeys(self._listed.difference(listed), now))
        self._listed = set(listed)

    def _replace_failed(self, listed: Mapping[str, WorkerDemand], now: float) -> None:
        """Members the cluster failed to start, or whose worker closed on its own (a
        nanny gone; a job ended, which the cluster lets go some seconds after its worker
        left), the scheduler not listing them: a ``SpecCluster`` never starts a failed one
        again, and would start a let-go one again under its old name at any later
        correction; either would count as starting meanwhile. Their specs go at once (the
        cluster closes their workers), so a new worker takes their place. The pool asks
        again after a wait, which doubles when one asked for since the wait began fails
        too, and ends once one of those arrives (a spec that cannot start starts no
        process a look)."""
        held = self._held
        self._held = set()
        for pool in self.pools:
            members = self.members(pool)
            self._held.update(w for w in members if cluster_holds(self.cluster, w))
            _, last, since = self._held_back.get(pool, (0.0, 0.0, math.inf))
            if failed := [
                w
                for w in members
                if w not in listed
                and (start_failed(self.cluster, w) or (w in held and w not in self._held))
            ]:
                # one asked for since the wait began failed too: it doubles, and begins
                # anew (else only older ones failed: the same wait again, still counting
                # arrivals and failures from when it began)
                again = any(self._started.get(w, -math.inf) >= since for w in failed)
                wait = min(RETRY_WAIT_MAX, 2 * last) if again else last or 1.0
                self._held_back[pool] = (now + wait, wait, now if again or not last else since)
                logger.warning(
                    "accelsched.adapt: pool %r: %s failed to start or closed; asked for again "
                    "in %.0fs",
                    pool,
                    ", ".join(
                        w + (f" ({why})" if (why := internals.build_error(self.cluster, w)) else "")
                        for w in failed
                    ),
                    wait,
                )
                self._drop(failed)
            elif any(w in listed and self._started.get(w, -math.inf) >= since for w in members):
                del self._held_back[pool]  # one asked for since it failed has arrived

    def _states(self, listed: Mapping[str, WorkerDemand], now: float) -> dict[str, PoolState]:
        """Each pool's workers: running (arrived, as the scheduler ``listed`` them; a GPU
        pool's once its devices are verified, or start_timeout passed), starting, and how
        long each idle one was."""
        # workers that could take a retired worker's results
        receivers = {n for n, w in listed.items() if w["running"]}
        states = {}
        for name, (pool, _) in self.pools.items():
            idle = {}
            starting = []  # when each was asked for
            members = self.members(name)
            for w in members:
                seen = listed.get(w)
                started = self._started.setdefault(w, now)  # (asked for by another)
                late = now - started >= self.options["start_timeout"]
                if pool.gpus and seen is not None and seen["gpus"]:
                    self._verified.add(w)
                if seen is None or (pool.gpus and not seen["gpus"] and not late):
                    starting.append(started)
                    continue
                if pool.gpus and w not in self._verified and w not in self._said_deviceless:
                    # it counts as the pool's worker from now on, serving no GPU task:
                    # said once, or GPU tasks waiting for the pool would wait unexplained
                    self._said_deviceless.add(w)
                    logger.warning(
                        "accelsched.adapt: pool %r: %s has no verified GPU %.0fs after it "
                        "was asked for; it counts as one of the pool's workers and serves "
                        "no GPU task (its GPU events, `accelsched status`, say why)",
                        name,
                        w,
                        now - started,
                    )
                if (
                    # a GPU pool's worker running only CPU tasks is idle where a CPU pool is
                    seen["gpu_busy" if pool.gpus and self._gpu_idle_with_cpu_work else "busy"]
                    or not seen["running"]  # paused, or drained by accelsched to restart it
                    # its results have nowhere to go: retiring it would fail (and each try
                    # is logged twice as a warning); idle once a peer is there or they go
                    or (seen["holds"] and not receivers - {w})
                ):
                    self._idle_since.pop(w, None)
                else:
                    idle[w] = now - self._idle_since.setdefault(w, now)
            self._awaited[name] = max(starting, default=-math.inf)
            states[name] = PoolState(len(members) - len(starting), len(starting), idle)
        # workers that left some other way (died, closed by hand): their times go
        known = {w for name in self.pools for w in self.members(name)}
        self._idle_since = {w: t for w, t in self._idle_since.items() if w in known}
        self._started = {w: t for w, t in self._started.items() if w in known}
        self._verified &= known
        self._said_deviceless &= known
        return states

    async def _scale_up(self, plan: Plan, now: float) -> None:
        spec = self.cluster.worker_spec
        before = len(spec)
        closing = {w for names in self._closes.values() for w in names}
        for name, (_, worker_spec) in self.pools.items():
            until = self._held_back.get(name, (0.0, 0.0, 0.0))[0]
            if now < until:
                continue  # one failed to start: asked again after a wait
            if now - until >= RETRY_WAIT_MAX and not plan.targets[name] and not self.members(name):
                # no failure for as long as the longest wait, nothing asked of it, nothing
                # in it: its failures are history (a failure once it is asked again waits
                # 1 s, not double the last wait; a look without demand between failures
                # forgets nothing)
                self._held_back.pop(name, None)
            # a free name is no member: its times went at this look (_states); nor one
            # the scheduler still lists (a closed worker's may linger, retiring: the new
            # worker would be taken for it, and refused the name), or stopped listing
            # lately (_see); nor one the cluster still holds a worker object for, or is
            # closing (it starts no new worker under a name it holds one for)
            free = (
                w
                for n in itertools.count()
                if (w := f"{name}-{n}") not in spec
                and w not in self._listed
                and w not in self._left
                and w not in closing
                and not cluster_holds(self.cluster, w)
            )
            new = [next(free) for _ in range(plan.targets[name] - len(self.members(name)))]
            spec.update({w: {**copy.deepcopy(worker_spec), "cls": self._build[name]} for w in new})
            self._started.update(dict.fromkeys(new, now))
            if new:
                self._awaited[name] = now  # awaited as of this look
                await self._event(
                    events.SCALE_UP,
                    pool=name,
                    workers=new,
                    reason=plan.reasons.get(name, "minimum"),
                    target=plan.targets[name],
                    classes=sorted(c for c, p in plan.coming.items() if p == name),
                )
        if len(spec) > before:  # the cluster starts what its spec has and it has not (not awaited)
            correct(self.cluster)

    async def _event(self, action: str, **figures: Any) -> None:
        msg = events.event(action, **figures)
        logger.log(*events.log_line(msg))
        await self.scheduler.log_event(topic=events.TOPIC, msg=msg)


def adapt(cluster: SpecCluster, pools: Any, **options: Any) -> ElasticPools:
    """Size ``cluster``'s named ``pools`` by the work accelsched sees waiting.

    ``pools``: ``{name: {"spec": {"cls": ..., "options": {...}}, "minimum": 0,
    "maximum": n, "devices": {"count": 1, "name": "NVIDIA H100 80GB HBM3",
    "memory": "80GiB", "capability": "9.0"}}}``; a pool without ``devices`` whose
    workers declare no ``GPU`` is a CPU pool. Options (dask config under
    ``accelsched.adapt.``): ``interval``, ``wait_count``, ``target_duration`` (as
    distributed's ``Adaptive``), ``idle_after``, ``start_timeout``. The scheduler must run
    accelsched's PlacementPlugin. Returns the running :class:`ElasticPools` (``.stop()``).
    """
    return ElasticPools(cluster, pools, **options)
