"""What ``accelsched status`` shows and how it ends: the table, the summary, the exit codes.

The snapshot comes from the scheduler's read-only ``accelsched_status`` handler
(:data:`~accelsched.protocol.STATUS_HANDLER`): a scheduler without accelsched answers
``None``, which is how a cluster without the PlacementPlugin is told apart from an
empty one. The dashboard page draws the same rows. The commands themselves, bounded in
time, are in :mod:`accelsched.cli.main`.

Exit codes (also in ``accelsched --help`` and docs/observe.md): :data:`OK`,
:data:`UNREACHABLE`, :data:`USAGE`, :data:`NO_ACCELSCHED`, and 130 after Ctrl-C before
an answer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final, cast

from dask.utils import format_bytes

from accelsched.events import shown
from accelsched.protocol import STATUS_HANDLER, DeviceStatus, StatusReply

if TYPE_CHECKING:
    from distributed import Client

__all__ = [
    "one_line",
    "shown",
    "snapshot",
    "table_rows",
    "render",
    "summary",
    "COLUMNS",
    "waits_for",
]

OK: Final = 0
#: The scheduler could not be reached within ``--timeout`` (nor its ``--scheduler-file``
#: read: missing or still empty), or went away under ``--watch``.
UNREACHABLE: Final = 1
#: Bad arguments (argparse's own code).
USAGE: Final = 2
#: The scheduler answers but runs no accelsched (no PlacementPlugin registered).
NO_ACCELSCHED: Final = 3

EXIT_CODES_HELP: Final = (
    "exit codes: 0 ok (also Ctrl-C under --watch, or the reader of the output gone); "
    "1 scheduler unreachable or its scheduler file not there yet (or lost while watching); "
    "2 bad arguments; 3 the scheduler runs no accelsched (PlacementPlugin not registered); "
    "130 Ctrl-C before an answer"
)

#: The table's columns (field, heading), shared with the dashboard page. ``accelsched
#: status`` leaves POOL out while no worker is in an elastic pool (``accelsched.adapt``).
COLUMNS: Final = [
    ("worker", "WORKER"),
    ("pool", "POOL"),
    ("device", "GPU"),
    ("gpu", "NAME"),
    ("memory", "MEMORY"),
    ("capability", "CC"),
    ("declared", "DECLARED"),
    ("uuid", "UUID"),
    ("leases", "LEASES"),
    ("leak", "LEAK/THRESHOLD"),
    ("restarts", "RESTARTS"),
    ("leaks", "LEAKS"),
    ("reclaims", "RECLAIMED"),
    ("fallbacks", "FALLBACKS"),
    ("quarantine", "QUARANTINE"),
]


#: What a quarantined worker waits for, by the reason it was quarantined: its guard asks
#: for the restart again at each confirmed leak, and the restart proceeds once this holds.
WAITS_FOR: Final = {
    "no-peer": "a peer to take its data",
    "retire-failed": "a peer to take its data",
    "concurrency": "a free restart slot",
    "busy": "its running tasks to end",
    "restart-failed": "its nanny to restart it",
    "no-nanny": "a restart by hand (it has no nanny)",
    "restart-budget": "its restart window to move on",
}


def waits_for(reason: str) -> str | None:
    """What a worker quarantined for ``reason`` waits for (None: nothing known)."""
    return WAITS_FOR.get(reason.removeprefix("restart-deferred: ").split(":", 1)[0])


def quarantine_text(reason: str | None) -> str:
    """The QUARANTINE column: why, and what it waits for; ``-`` when not quarantined."""
    if not reason:
        return "-"
    return f"{reason}; waits for {wanted}" if (wanted := waits_for(reason)) else reason


def one_line(exc: BaseException) -> str:
    """An error as ``TypeName: detail`` on one line (an OSError by its ``strerror``): the
    detail may quote what a peer sent, so it is :func:`shown`."""
    detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    detail = shown(" ".join(detail.split()))
    return f"{type(exc).__name__}: {detail}" if detail else type(exc).__name__


def _bytes(nbytes: int | None) -> str:
    return "-" if nbytes is None else format_bytes(nbytes)


def table_rows(snap: StatusReply) -> dict[str, list[str]]:
    """Columns of text: one row per worker and verified GPU, one for a worker without."""
    rows = [
        {
            "worker": w["name"],
            "pool": w.get("pool") or "-",  # absent from an earlier accelsched
            "device": "-" if d is None else str(d["index"]),
            "gpu": "no verified GPU"
            if d is None
            else d["name"] + (" (withdrawn)" if d["withdrawn"] else ""),
            "memory": _bytes(None if d is None else d["memory"]),
            "capability": "-" if d is None else d.get("capability") or "?",
            "declared": _bytes((d.get("declared") or None) if d is not None else None),
            "uuid": "-" if d is None else d["uuid"],
            "leases": "-" if d is None or d["leases"] is None else str(d["leases"]),
            "leak": "-"
            if d is None
            # granted since the worker's last heartbeat: no figures yet (DeviceStatus)
            else "waiting for the first heartbeat"
            if d.get("figures") == "waiting"
            else f"{_bytes(None if d['leak_estimate'] is None else max(d['leak_estimate'], 0))}"
            f"/{_bytes(d['leak_threshold'])}",
            "restarts": str(w["restarts"]),
            "leaks": str(w["leaks"]),
            "reclaims": str(w["reclaims"]),
            "fallbacks": str(w["fallbacks"]),
            "quarantine": quarantine_text(w["quarantined"]),
        }
        for w in snap["workers"]
        for d in cast("list[DeviceStatus | None]", w["devices"] or [None])
    ]
    return {c: [row[c] for row in rows] for c, _ in COLUMNS}


def summary(snap: StatusReply) -> str:
    """One line: the cluster at a glance."""
    workers = snap["workers"]
    line = (
        f"{len(workers)} workers, {sum(len(w['devices']) for w in workers)} verified GPUs, "
        f"{sum(1 for w in workers if w['quarantined'])} quarantined; "
        f"{snap['restarts']} restarts, {snap['leaks']} leaks, {snap['reclaims']} reclaimed, "
        f"{snap['fallbacks']} fallbacks"
    )
    if waiting := snap.get("waiting"):  # a scheduler of an earlier accelsched has none
        why = ", ".join(f"{n} {reason}" for reason, n in waiting.items())
        line += f"; {sum(waiting.values())} GPU tasks waiting ({why})"
    if not snap["guard"]:
        line += " (no GuardPlugin registered: no GPU is verified)"
    return line


def render(snap: StatusReply) -> str:
    """The text ``accelsched status`` prints: a summary line, the options and the table, every cell
    :func:`shown` (names come from the cluster) before the widths are taken."""
    rows = {c: [shown(v) for v in cells] for c, cells in table_rows(snap).items()}
    columns = [(c, h) for c, h in COLUMNS if c != "pool" or set(rows[c]) - {"-"}]
    widths = {c: max([len(h)] + [len(v) for v in rows[c]]) for c, h in columns}
    # the PlacementPlugin's options in effect (``register``'s keywords, in seconds); a
    # scheduler of an earlier accelsched has none
    options = snap.get("options")
    lines = [
        f"scheduler {shown(snap['scheduler'])}: {summary(snap)}",
        "options: not reported (an earlier accelsched)"
        if options is None
        else "options: " + ", ".join(f"{k}={shown(v)}" for k, v in options.items()),
        "  ".join(h.ljust(widths[c]) for c, h in columns).rstrip(),
        *(
            "  ".join(rows[c][i].ljust(widths[c]) for c, _ in columns).rstrip()
            for i in range(len(rows["worker"]))
        ),
    ]
    return "\n".join(lines)


def snapshot(client: Client) -> StatusReply | None:
    """The scheduler's snapshot (what ``accelsched status --json`` prints), through a
    synchronous ``client``; None when the scheduler runs no accelsched (it has no such
    handler: it answers None, and logs a warning of its own)."""
    return cast("StatusReply | None", client.sync(getattr(client.scheduler, STATUS_HANDLER)))
