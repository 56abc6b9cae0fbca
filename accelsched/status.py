"""``accelsched status`` and ``accelsched events``: read a running cluster from outside.

Both ask the scheduler's read-only ``accelsched_status`` handler
(:data:`~accelsched.protocol.STATUS_HANDLER`) first: a scheduler without accelsched
answers ``None``, which is how a cluster without the PlacementPlugin is told apart
from an empty one. Workers are shown by name; ``events`` maps the addresses in old
events (a restarted worker's previous address) to names through the same reply.

Exit codes (also in ``accelsched --help`` and docs/observe.md): :data:`OK`,
:data:`UNREACHABLE`, :data:`USAGE`, :data:`NO_ACCELSCHED`.
"""

from __future__ import annotations

import json
import sys
import time
from typing import TYPE_CHECKING, Any, Final, TextIO

from accelsched.protocol import STATUS_HANDLER, DeviceStatus, StatusReply

if TYPE_CHECKING:
    from distributed import Client

__all__ = [
    "snapshot",
    "print_status",
    "print_events",
    "table_rows",
    "render",
    "summary",
    "COLUMNS",
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
    "exit codes: 0 ok; 1 scheduler unreachable or its scheduler file not there yet "
    "(or lost while watching); "
    "2 bad arguments; 3 the scheduler runs no accelsched (PlacementPlugin not registered)"
)

MiB = 2**20

#: The table's columns (field, heading), shared with the dashboard page.
COLUMNS: Final = [
    ("worker", "WORKER"),
    ("device", "GPU"),
    ("gpu", "NAME"),
    ("memory", "MEMORY"),
    ("uuid", "UUID"),
    ("leases", "LEASES"),
    ("leak", "LEAK/THRESHOLD"),
    ("restarts", "RESTARTS"),
    ("leaks", "LEAKS"),
    ("fallbacks", "FALLBACKS"),
    ("quarantine", "QUARANTINE"),
]


def table_rows(snap: StatusReply) -> dict[str, list[str]]:
    """Columns of text: one row per worker and verified GPU, one for a worker without."""
    rows: dict[str, list[str]] = {c: [] for c, _ in COLUMNS}
    for w in snap["workers"]:
        devices: list[DeviceStatus | None] = list(w["devices"]) or [None]
        for d in devices:
            row = {
                "worker": w["name"],
                "device": "-" if d is None else str(d["index"]),
                "gpu": "no verified GPU" if d is None else d["name"],
                "memory": "-" if d is None else f"{d['memory'] / 2**30:.1f} GiB",
                "uuid": "-" if d is None else d["uuid"],
                "leases": "-" if d is None or d["leases"] is None else str(d["leases"]),
                "leak": "-" if d is None else _leak(d["leak_estimate"], d["leak_threshold"]),
                "restarts": str(w["restarts"]),
                "leaks": str(w["leaks"]),
                "fallbacks": str(w["fallbacks"]),
                "quarantine": w["quarantined"] or "-",
            }
            if d is not None and d["withdrawn"]:
                row["gpu"] += " (withdrawn)"
            for c, _ in COLUMNS:
                rows[c].append(row[c])
    return rows


def _leak(estimate: int | None, threshold: int | None) -> str:
    est = "-" if estimate is None else f"{max(estimate, 0) / MiB:.0f}"
    thr = "-" if threshold is None else f"{threshold / MiB:.0f}"
    return f"{est}/{thr} MiB"


def summary(snap: StatusReply) -> str:
    """One line: the cluster at a glance."""
    gpus = sum(len(w["devices"]) for w in snap["workers"])
    quarantined = sum(1 for w in snap["workers"] if w["quarantined"])
    line = (
        f"{len(snap['workers'])} workers, {gpus} verified GPUs, {quarantined} quarantined; "
        f"{snap['restarts']} restarts, {snap['leaks']} leaks, {snap['fallbacks']} fallbacks"
    )
    if not snap["guard"]:
        line += " (no GuardPlugin registered: no GPU is verified)"
    return line


def render(snap: StatusReply) -> str:
    """The text ``accelsched status`` prints: a summary line and the table."""
    rows = table_rows(snap)
    n = len(rows["worker"])
    widths = {c: max([len(h)] + [len(v) for v in rows[c]]) for c, h in COLUMNS}
    lines = [f"scheduler {snap['scheduler']}: {summary(snap)}"]
    lines.append("  ".join(h.ljust(widths[c]) for c, h in COLUMNS).rstrip())
    for i in range(n):
        lines.append("  ".join(rows[c][i].ljust(widths[c]) for c, _ in COLUMNS).rstrip())
    return "\n".join(lines)


def _connect(address: str, timeout: str, command: str) -> Client | int:
    """A client, or the exit code: :data:`UNREACHABLE`, or :data:`USAGE` for a string
    that is no address (distributed raises ``ValueError`` for those)."""
    from distributed import Client

    try:
        return Client(address, timeout=timeout)
    except (OSError, TimeoutError) as exc:
        print(
            f"accelsched {command}: cannot reach a scheduler at {address}: {exc}", file=sys.stderr
        )
        return UNREACHABLE
    except ValueError as exc:  # no address: "unknown address scheme", "missing port"
        print(
            f"accelsched {command}: invalid scheduler address {address!r}: {exc}", file=sys.stderr
        )
        return USAGE


def snapshot(client: Client) -> StatusReply | None:
    """The scheduler's snapshot (what ``accelsched status --json`` prints), through a
    synchronous ``client``; None when the scheduler runs no accelsched (it has no such
    handler: it answers None, and logs a warning of its own)."""
    reply: StatusReply | None = client.sync(getattr(client.scheduler, STATUS_HANDLER))
    return reply


def _no_accelsched(command: str, address: str) -> int:
    print(
        f"accelsched {command}: the scheduler at {address} runs no accelsched "
        "(no PlacementPlugin registered: accelsched.register(client) or "
        "dask scheduler --preload accelsched)",
        file=sys.stderr,
    )
    return NO_ACCELSCHED


def print_status(
    address: str,
    out: TextIO,
    *,
    as_json: bool = False,
    watch: float | None = None,
    timeout: str = "10s",
) -> int:
    """``accelsched status``: the table (or ``--json``), once or every ``watch`` seconds
    until Ctrl-C."""
    client = _connect(address, timeout, "status")
    if isinstance(client, int):
        return client
    with client:
        try:
            while True:
                try:
                    snap = snapshot(client)
                except (OSError, TimeoutError) as exc:
                    print(
                        f"accelsched status: lost the scheduler at {address}: {exc}",
                        file=sys.stderr,
                    )
                    return UNREACHABLE
                if snap is None:
                    return _no_accelsched("status", address)
                if as_json:
                    print(json.dumps(snap, sort_keys=True), file=out)
                else:
                    if watch is not None and out.isatty():
                        out.write("\x1b[H\x1b[2J")  # redraw in place
                    elif watch is not None:
                        print(time.strftime("-- %H:%M:%S"), file=out)
                    print(render(snap), file=out)
                out.flush()
                if watch is None:
                    return OK
                time.sleep(watch)
        except KeyboardInterrupt:
            return OK


def print_events(address: str, actions: list[str] | None, out: TextIO, timeout: str = "10s") -> int:
    """``accelsched events``: the scheduler's accelsched events, oldest first, workers by
    name (a restarted worker's old address too)."""
    from accelsched import events

    unknown = sorted(set(actions or ()) - events.ACTIONS)
    if unknown:
        print(f"unknown action(s) {unknown}; known: {sorted(events.ACTIONS)}", file=sys.stderr)
        return USAGE
    client = _connect(address, timeout, "events")
    if isinstance(client, int):
        return client
    with client:
        try:
            snap = snapshot(client)
            log = [] if snap is None else client.get_events(events.TOPIC)
        except (OSError, TimeoutError) as exc:
            print(f"accelsched events: lost the scheduler at {address}: {exc}", file=sys.stderr)
            return UNREACHABLE
        if snap is None:
            return _no_accelsched("events", address)
        names: dict[str, Any] = dict(snap["names"])
        for stamp, msg in log:
            if not isinstance(msg, dict) or msg.get("action") not in events.ACTIONS:
                continue  # any client may log to any topic: not one of ours
            if actions and msg["action"] not in actions:
                continue
            owner = msg.get("owner")
            if isinstance(owner, str):  # gpu-rejected: the owner's address(es), by name too
                msg = {**msg, "owner": names.get(owner, owner)}
            elif isinstance(owner, list):
                msg = {
                    **msg,
                    "owner": [names.get(o, o) if isinstance(o, str) else o for o in owner],
                }
            when = time.strftime("%H:%M:%S", time.localtime(stamp))
            print(f"{when} [{msg['action']}] {events.describe(msg, names)}", file=out)
    return OK
