"""The demo's output: tables and event lines built from the scheduler's events."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from typing import Any, TextIO

from distributed import Client

import accelsched
from accelsched import internals
from accelsched.demo.steps import DEMO_TOPIC


def table(rows: list[list[str]], header: list[str], out: TextIO) -> None:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, ["-" * w for w in widths], *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip(), file=out)


def events(client: Client, topic: str, since: float) -> list[dict[str, Any]]:
    return [m for t, m in client.get_events(topic) if t >= since]


def _task(key: Any) -> Any:
    """A task key as events carry it, hashable (msgpack may turn a tuple into a list)."""
    return tuple(_task(k) for k in key) if isinstance(key, (list, tuple)) else key


def task_runs(
    demo: list[dict[str, Any]],
    fallbacks: dict[Any, dict[str, Any]],
    names: dict[str, str],
    uuids: dict[tuple[str, int], str],
) -> tuple[list[list[str]], int]:
    """One row per run of a task, from the steps' own records (``demo``, in the order
    they ran) and the scheduler's ``fallbacks`` (by task). Dask fuses a block's steps
    into one task, and fallback events count tasks: rows by task, not by step, are what
    the count can be read against. A task that ran again (its worker left while it ran)
    has a row per run, the first marked. Returns the rows and how many tasks ran again."""
    runs: dict[tuple[Any, str, Any], dict[str, Any]] = {}
    for e in demo:
        ident = (_task(e.get("key")), e["worker"], e["device"])
        run = runs.setdefault(ident, {"block": e["block"], "steps": []})
        if e["step"] not in run["steps"]:
            run["steps"].append(e["step"])
    times: dict[Any, int] = {}
    for key, _, _ in runs:
        times[key] = times.get(key, 0) + 1
    rows = []
    seen: dict[Any, int] = {}
    for (key, worker, device), run in sorted(runs.items(), key=lambda kv: kv[1]["block"]):
        seen[key] = seen.get(key, 0) + 1
        if device is None:
            where, index = ("CPU (fallback)" if key in fallbacks else "CPU"), "-"
        else:
            where, index = uuids.get((worker, device), "GPU")[:12], str(device)
        note = "its worker left while it ran: ran again" if seen[key] < times[key] else ""
        rows.append(
            [str(run["block"]), "+".join(run["steps"]), names.get(worker, worker), where, index]
            + [note]
        )
    return rows, sum(1 for n in times.values() if n > 1)


def placement_table(
    client: Client,
    since: float,
    names: dict[str, str],
    uuids: dict[tuple[str, int], str],
    out: TextIO,
) -> None:
    fallbacks = {}
    for e in events(client, accelsched.events.TOPIC, since):
        if e["action"] == "fallback" and "key" in e:
            fallbacks[_task(e["key"])] = e
    demo = [m for t, m in sorted(client.get_events(DEMO_TOPIC), key=lambda tm: tm[0]) if t >= since]
    rows, again = task_runs(demo, fallbacks, names, uuids)
    header = ["block", "steps", "worker", "ran on", "CUDA index", "note"]
    if not any(r[-1] for r in rows):
        header, rows = header[:-1], [r[:-1] for r in rows]
    table(rows, header, out)
    tasks = len({_task(e.get("key")) for e in demo})
    print(
        f"One row per run of a task: dask fused each block's steps into one task ({tasks} "
        "tasks). Each worker sees only its own GPU, as its CUDA index 0; the UUID tells "
        "the physical GPUs apart.",
        file=out,
    )
    if again:
        print(
            f"{again} task(s) were running on a GPU worker when it retired: that run was "
            "lost with the worker, and the task ran again.",
            file=out,
        )
    if fallbacks:
        reasons: dict[str, int] = {}
        for e in fallbacks.values():
            reasons[e["reason"]] = reasons.get(e["reason"], 0) + 1
        waited = max(e["waited"] for e in fallbacks.values())
        print(
            f"{len(fallbacks)} of the {tasks} GPU tasks fell back to their CPU form "
            f"({', '.join(f'{n} {r}' for r, n in reasons.items())}; longest wait {waited:.2f}s).",
            file=out,
        )
    print(file=out)


def event_lines(
    client: Client,
    since: float,
    names: dict[str, str],
    out: TextIO,
    skip: tuple[str, ...] = (),
    on_purpose: Collection[str] = (),
) -> None:
    """The accelsched events since ``since``, a line each; a ``gpu-corrected`` of a
    worker the demo mis-declares on purpose (``on_purpose``: names) says so, lest it
    read as a mistake in the set-up."""
    for e in events(client, accelsched.events.TOPIC, since):
        if e["action"] in skip:
            continue
        line = f"  [{e['action']}] {accelsched.events.describe(e, names)}"
        worker = names.get(e.get("worker", ""), e.get("worker"))
        if e["action"] == accelsched.events.GPU_CORRECTED and worker in on_purpose:
            line += " - mis-declared on purpose"
        print(line, file=out)
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
    return {addr: str(w["name"]) for addr, w in internals.workers_listed(client).items()}


def wait(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"demo: timed out waiting for {what}")
        time.sleep(0.05)
