"""The events accelsched writes to the scheduler's event log, topic ``"accelsched"``.

Events are the single record of what accelsched decided: tests, the demo and the CLI read
them with ``client.get_events("accelsched")``. Each is a dict with ``"action"`` (below),
``"worker"`` (an address, when one is concerned) and the figures that explain it.

``gpu-verified`` (scheduler)
    A worker's GuardPlugin probed its devices through NVML and the scheduler granted them.
    ``devices``: list of ``{"index", "uuid", "name", "memory"}``; ``granted``: GPU count.
``gpu-corrected`` (scheduler)
    The GPU count a worker declared differs from what it was granted. ``declared``,
    ``granted``, ``reason`` (``"fewer-devices"``, ``"no-devices"``, ``"advertised"``, or
    ``"owned"`` when another worker owns some of its GPUs).
``gpu-rejected`` (scheduler)
    GPUs a worker claimed were refused because another worker owns them. ``uuids``,
    ``reason`` (``"owned"``), ``owner`` (the owner's address, or a list of them).
``unrequested-gpu-use`` (worker)
    A task that did not ask for a GPU created a CUDA context or grew its process's device
    memory. ``key``, ``device``, ``nbytes``, ``context_created``, ``failed``.
``fallback`` (scheduler; worker for ``oom``)
    A GPU task runs its CPU form. ``key``, ``waited`` (seconds), ``reason``
    (``"timeout"``, ``"no-gpu-capacity"``, ``"chain"``, ``"oom"``); ``error`` for ``oom``.
``leak`` (worker)
    A worker's device memory, net of live results and pool caches, stayed above the
    threshold. ``device``, ``nbytes``, ``threshold``, ``checks`` (consecutive checks
    above it), ``prefixes`` (the steps whose measured runs left memory behind, most
    first; else every task prefix run since the last clean check, less those seen to
    leave nothing at every run), ``attributed``
    (``{step: bytes}``), ``unexplained`` (bytes no measured run accounts for),
    ``reclaimed`` (bytes garbage collection and a pool free gave back first, not
    enough; see ``leak-reclaimed``). Reported once per leak (again only if it grows by
    another threshold).
``leak-reclaimed`` (worker)
    A confirmed leak came back before any restart: the guard collected garbage
    (``gc.collect()``: reference cycles, a failed task's traceback holding its frames'
    device arrays) and freed the pools, measured again, and found the estimate at or
    under the threshold, so it asked for no restart. ``device``, ``nbytes`` (the estimate
    before), ``reclaimed`` (bytes the estimate fell by), ``remaining`` (the estimate
    after), ``threshold``, ``prefixes`` (as in ``leak``), ``seconds`` (collecting,
    freeing and measuring again). When memory stays held, the ``leak`` event follows
    instead, with what was reclaimed in ``reclaimed``.
``restart`` (scheduler)
    A worker was drained, retired (its data moved to peers) and restarted through its
    nanny. ``reason``, ``moved`` (keys it held), ``seconds`` (request to restart).
``restart-deferred`` (scheduler)
    A restart was wanted but cannot happen without loss now; a leaking worker is
    quarantined (one asking for an unhealthy device is not: that device is withdrawn)
    and the guard asks again at its next confirmed leak. ``reason`` (``"no-peer"``,
    ``"no-nanny"``, ``"busy"``, ``"retire-failed"``, ``"concurrency"``,
    ``"restart-failed: ..."``). Said once per reason.
``quarantine`` (scheduler)
    A worker's GPUs are taken out of placement (its GPU resource is 0) until it restarts
    or leaves. ``reason`` (``"restart-budget"`` or ``"restart-deferred: ..."``).
``gpu-unhealthy`` (worker)
    A verified device stopped answering NVML: no new lease lands on it, the worker
    advertises one GPU fewer; the worker keeps its process (no restart while the device
    fails) and offers it again once it answers. Said once per failure.
    ``device``, ``uuid``, ``error``.
``gpu-recovered`` (worker)
    A device withdrawn as unhealthy answers NVML again and is offered again
    (``recover_gpus``). ``device``, ``uuid``.
``unmet-requirement`` (scheduler)
    A GPU task's requirement (memory, model, capability, MIG) is met by no verified
    device in the cluster: its tasks wait for a worker that has one, or run their CPU
    form after their timeout. ``requirement`` (what was asked, e.g.
    ``"memory>=60GiB,model=*H100*"``), ``key`` (the first task), ``declarable`` (the
    most device memory a task may declare on any verified device: its memory less a
    reserve; None with none verified). Said once per requirement until a device meets it.
``gpu-waiting`` (scheduler)
    GPU tasks no worker took for a few seconds, and why: ``reason`` (``"no-verified-gpu"``,
    ``"too-few-gpus"``, ``"unmet-requirement"``, ``"no-eligible-worker"``), ``waiting``
    (how many, now), ``keys`` (a few of them). Said once per reason, again only after no
    task waited for it.
``over-declared`` (worker)
    A task that declared device memory added more than it declared to its device
    (measured as the ledger measures every GPU task): a neighbour sharing the device may
    run out. ``key``, ``device``, ``declared``, ``measured`` (bytes).
``scale-up`` (client: :func:`accelsched.adapt`)
    Elastic pools start workers. ``pool``, ``workers`` (their names, ``<pool>-<n>``),
    ``reason`` (``"gpu-demand"``: GPU tasks this pool's devices serve wait or run;
    ``"cpu-demand"``; ``"minimum"``), ``target`` (the pool's workers wanted),
    ``classes`` (the waiting GPU classes it serves, e.g. ``"1x any"``).
``scale-down`` (client: :func:`accelsched.adapt`)
    Elastic pools retire idle workers (their data moved to peers first). ``pool``,
    ``workers``, ``reason`` (``"idle"``), ``target``.
``request-refused`` (scheduler)
    A request naming a worker was not acted on: it came from a process the scheduler no
    longer holds at that address (``"stale"``: a late request from a process since
    replaced), it carried no id (``"no-id"``), or its id was seen before
    (``"replayed"``). Nothing changed. ``handler``, ``reason``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any, Final

from dask.utils import format_bytes

from accelsched.policy.timeouts import REASONS

TOPIC: Final = "accelsched"

GPU_VERIFIED: Final = "gpu-verified"
GPU_CORRECTED: Final = "gpu-corrected"
GPU_REJECTED: Final = "gpu-rejected"
UNREQUESTED_GPU_USE: Final = "unrequested-gpu-use"
FALLBACK: Final = "fallback"
LEAK: Final = "leak"
LEAK_RECLAIMED: Final = "leak-reclaimed"
RESTART: Final = "restart"
RESTART_DEFERRED: Final = "restart-deferred"
QUARANTINE: Final = "quarantine"
GPU_UNHEALTHY: Final = "gpu-unhealthy"
GPU_RECOVERED: Final = "gpu-recovered"
REQUEST_REFUSED: Final = "request-refused"
UNMET_REQUIREMENT: Final = "unmet-requirement"
OVER_DECLARED: Final = "over-declared"
GPU_WAITING: Final = "gpu-waiting"
SCALE_UP: Final = "scale-up"
SCALE_DOWN: Final = "scale-down"

ACTIONS: Final = frozenset(
    {
        GPU_VERIFIED,
        GPU_CORRECTED,
        GPU_REJECTED,
        UNREQUESTED_GPU_USE,
        FALLBACK,
        LEAK,
        LEAK_RECLAIMED,
        RESTART,
        RESTART_DEFERRED,
        QUARANTINE,
        GPU_UNHEALTHY,
        GPU_RECOVERED,
        REQUEST_REFUSED,
        UNMET_REQUIREMENT,
        OVER_DECLARED,
        GPU_WAITING,
        SCALE_UP,
        SCALE_DOWN,
    }
)


def event(action: str, worker: str | None = None, **figures: Any) -> dict[str, Any]:
    """Build an event dict; the action must be one documented above."""
    if action not in ACTIONS:
        raise ValueError(f"unknown accelsched event action {action!r}")
    return {"action": action, **({} if worker is None else {"worker": worker}), **figures}


#: Actions an operator should look at: logged at WARNING, the others at INFO.
WARNING_ACTIONS: Final = frozenset(
    {
        GPU_REJECTED,
        UNREQUESTED_GPU_USE,
        LEAK,
        RESTART_DEFERRED,
        QUARANTINE,
        GPU_UNHEALTHY,
        REQUEST_REFUSED,
        OVER_DECLARED,
    }
)


def log_line(msg: Mapping[str, Any]) -> tuple[int, str]:
    """The level and the line an event is logged with (``logger.log(*log_line(msg))``):
    ``accelsched [leak] tcp://...: device 0 leaks 512.00 MiB ...``.

    Any client may log to the topic, so what the event carries is :func:`shown` (one
    printable line): a newline in a key cannot forge a line of the log.
    """
    action = msg.get("action")
    level = (
        logging.WARNING if isinstance(action, str) and action in WARNING_ACTIONS else logging.INFO
    )
    return level, f"accelsched [{shown(action)}] {shown(describe(msg))}"


def shown(text: object) -> str:
    """``text`` as one printable line, for every value the commands print that they did
    not write themselves (worker and device names, UUIDs, event details, addresses,
    paths, errors).

    Anyone can name a worker, and a worker reports its own device names: a name holding a
    terminal escape (``"\\x1b[2J"``) would clear the reader's screen, a newline would
    forge a row of the table, a bidi override would reorder what follows it. Such a
    value is shown quoted, escaped (``'\\x1b[2J'``): it is seen and never acts, and the
    quotes tell it from a name that merely looks like an escape. A printable value
    (non-ASCII letters too) is shown as it is."""
    text = str(text)
    return text if text.isprintable() else ascii(text)


def describe(msg: Mapping[str, Any], names: Mapping[str, str] | None = None) -> str:
    """One line a person can read, for the demo and ``accelsched events``.

    ``names`` maps worker addresses to worker names.
    """
    worker = msg.get("worker", "")
    w = (names or {}).get(worker, worker) if isinstance(worker, str) else repr(worker)
    details = {k: v for k, v in msg.items() if k not in ("action", "worker")}
    try:
        action = msg["action"]
        line = _LINES.get(action) if isinstance(action, str) else None
        return f"{w}: {details}" if line is None else line(msg, w)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError):
        # any client may log to the topic: an event of ours without its usual figures
        return f"{w}: {msg.get('action')} {details}"


def _size(nbytes: Any) -> str:
    """Bytes as dask writes them (``dask.utils.format_bytes``: ``512.00 MiB``)."""
    return format_bytes(int(nbytes))


def _listed(items: Any, quote: bool = False) -> str:
    """A list in words: ``a, b, c`` (keys quoted as Python writes them), ``none`` if empty."""
    out = [repr(i) if quote else str(i) for i in items]
    return ", ".join(out) if out else "none"


def _corrected(m: Mapping[str, Any], w: str) -> str:
    declared, granted, reason = m["declared"], m["granted"], str(m["reason"])
    if declared is None and reason == "advertised":  # not a mistake: advertise_undeclared
        return f"{w}: declared no GPU; advertises the {granted} it has (advertise_undeclared)"
    if declared is None:
        return f"{w}: declared no usable GPU count; granted {granted} ({reason})"
    return f"{w}: declared GPU={declared}, granted {granted} ({reason})"


def _fallback(m: Mapping[str, Any], w: str) -> str:
    where = f" on {w}" if w else ""
    full = m.get("pools_at_maximum")
    pools = f"; pools at maximum: {_listed(full)}" if full else ""
    if "key" not in m:  # a burst of fallbacks comes summarised, without a key
        reasons = ", ".join(f"{n} {r}" for r, n in dict(m["reasons"]).items())
        return (
            f"{m['count']} tasks fell back{where} ({reasons}{pools}; waited {m['waited']}s "
            f"median, {m['waited_max']}s max; e.g. {_listed(list(m['keys'])[:3], quote=True)})"
        )
    why = f"{m['reason']}: {m['error']}" if "error" in m else m["reason"]
    return (
        f"task {m['key']!r}{where}: fell back to its CPU form after {m['waited']}s ({why}{pools})"
    )


#: A line in words for every action: (event, worker).
_LINES: dict[str, Callable[[Mapping[str, Any], str], str]] = {
    GPU_VERIFIED: lambda m, w: (
        f"{w}: verified {m['granted']} GPU(s): "
        + "; ".join(f"{d['name']}, UUID {d['uuid']}, CUDA index {d['index']}" for d in m["devices"])
    ),
    GPU_CORRECTED: _corrected,
    GPU_REJECTED: lambda m, w: (
        f"{w}: refused {_listed(m['uuids'])}: "
        + ("owned by" if m["reason"] == "owned" else f"{m['reason']}, owner")
        + f" {_listed([m['owner']] if isinstance(m['owner'], str) else m['owner'])}"
    ),
    UNREQUESTED_GPU_USE: lambda m, w: (
        f"{w}: task {m['key']!r} used device {m['device']} without asking for a GPU "
        f"(+{_size(m['nbytes'])}"
        + ("; a CUDA context created" if m.get("context_created") else "")
        + ("; the task made to fail" if m.get("failed") else "")
        + ")"
    ),
    FALLBACK: _fallback,
    LEAK: lambda m, w: (
        f"{w}: device {m['device']} leaks {_size(m['nbytes'])} "
        f"(threshold {_size(m['threshold'])}, prefixes {_listed(m['prefixes'])})"
    ),
    LEAK_RECLAIMED: lambda m, w: (
        f"{w}: device {m['device']} got {_size(m['reclaimed'])} back by collecting garbage "
        f"and freeing pools ({_size(m['remaining'])} left, threshold {_size(m['threshold'])}, "
        f"prefixes {_listed(m['prefixes'])}): no restart"
    ),
    RESTART: lambda m, w: (
        f"{w}: retired ({m['moved']} keys moved to peers) and restarted in {m['seconds']}s "
        f"({m['reason']})"
    ),
    RESTART_DEFERRED: lambda m, w: f"{w}: restart deferred ({m['reason']})",
    QUARANTINE: lambda m, w: (
        f"{w}: GPUs taken out of placement until it restarts or leaves ({m['reason']})"
    ),
    GPU_UNHEALTHY: lambda m, w: (
        f"{w}: device {m['device']} ({m['uuid']}) stopped answering NVML: withdrawn ({m['error']})"
    ),
    GPU_RECOVERED: lambda m, w: (
        f"{w}: device {m['device']} ({m['uuid']}) answers NVML again: offered again"
    ),
    REQUEST_REFUSED: lambda m, w: f"{w}: {m['handler']} request refused ({m['reason']})",
    UNMET_REQUIREMENT: lambda m, w: (
        f"no verified device meets {m['requirement']} (task {m['key']!r} waits"
        + (
            ""
            if m.get("declarable") is None
            else f"; the most a task may declare on one here: {_size(m['declarable'])}"
        )
        + ")"
    ),
    SCALE_UP: lambda m, w: (
        f"pool {m['pool']!r}: starting {_listed(m['workers'])} ({m['reason']}"
        + (f": {_listed(m['classes'])}" if m.get("classes") else "")
        + f"; target {m['target']})"
    ),
    SCALE_DOWN: lambda m, w: (
        f"pool {m['pool']!r}: retiring {_listed(m['workers'])} ({m['reason']}; "
        f"target {m['target']})"
    ),
    GPU_WAITING: lambda m, w: (
        f"{m['waiting']} GPU task(s) wait unplaced: {REASONS.get(m['reason'], m['reason'])} "
        f"(e.g. {_listed(m['keys'], quote=True)})"
    ),
    OVER_DECLARED: lambda m, w: (
        f"{w}: task {m['key']!r} declared {_size(m['declared'])}, added "
        f"{_size(m['measured'])} on device {m['device']}"
    ),
}
