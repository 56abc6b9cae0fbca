"""The demo's output: tables and event lines built from the scheduler's events."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TextIO

from distributed import Client

import accelsched
from accelsched.demo.steps import DEMO_TOPIC


def table(rows: list[list[str]], header: list[str], out: TextIO) -> None:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = "  ".join("-" * w for w in widths)
    print("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)), file=out)
    print(line, file=out)
    for r in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)), file=out)
    print(file=out)


def events(client: Client, topic: str, since: float) -> list[dict[str, Any]]:
    return [m for t, m in client.get_events(topic) if t >= since]


def placement_table(
    client: Client,
    since: float,
    names: dict[str, str],
    uuids: dict[tuple[str, int], str],
    out: TextIO,
) -> None:
    fallbacks = {}
    for e in events(client, accelsched.events.TOPIC, since):
        if e["action"] == "fallback":
            fallbacks[e["key"]] = e
    rows = []
    seen = set()
    for e in sorted(
        events(client, DEMO_TOPIC, since), key=lambda e: (e["step"] != "normalise", e["block"])
    ):
        ident = (e["step"], e["block"])
        if ident in seen:
            continue
        seen.add(ident)
        if e["device"] is None:
            where = "CPU (fallback)" if fallbacks else "CPU"
        else:
            uuid = uuids.get((e["worker"], e["device"]), "")
            where = f"GPU {e['device']} {uuid[:12]}"
        rows.append([e["step"], str(e["block"]), names.get(e["worker"], e["worker"]), where])
    table(rows, ["step", "block", "worker", "ran on"], out)
    if fallbacks:
        reasons: dict[str, int] = {}
        for e in fallbacks.values():
            reasons[e["reason"]] = reasons.get(e["reason"], 0) + 1
        waited = max(e["waited"] for e in fallbacks.values())
        print(
            f"{len(fallbacks)} GPU task(s) fell back to their CPU form "
            f"({', '.join(f'{n} {r}' for r, n in reasons.items())}; longest wait {waited:.2f}s).",
            file=out,
        )


def event_lines(client: Client, since: float, names: dict[str, str], out: TextIO, skip=()) -> None:  # type: ignore[no-untyped-def]
    for e in events(client, accelsched.events.TOPIC, since):
        if e["action"] in skip:
            continue
        print(f"  [{e['action']}] {accelsched.events.describe(e, names)}", file=out)
    print(file=out)


def uuids(client: Client) -> dict[tuple[str, int], str]:
    """(worker address, CUDA index) -> GPU UUID, from the verification events."""
    out = {}
    for e in events(client, accelsched.events.TOPIC, 0):
        if e["action"] == "gpu-verified":
            for d in e["devices"]:
                out[(e["worker"], d["index"])] = d["uuid"]
    return out


def worker_names(client: Client) -> dict[str, str]:
    info = client.scheduler_info(n_workers=-1)["workers"]
    return {addr: str(w["name"]) for addr, w in info.items()}


def wait(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"demo: timed out waiting for {what}")
        time.sleep(0.05)
