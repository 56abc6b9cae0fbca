"""What the soak reads back at its end: the scheduler's and the workers' view of tasks
that did not end (why they are stuck), accelsched's events, waits, the processes' logs."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from distributed import Client

#: Events kept whole in the figures (the first 20): the rarer decisions.
NOTABLE = ("unmet-requirement", "quarantine", "gpu-unhealthy", "restart-deferred", "gpu-rejected")


def _scheduler_view(keys: list[str], dask_scheduler: Any = None) -> dict[str, Any]:
    """What the scheduler knows of ``keys``: state, restrictions, worker, inputs."""
    s, out = dask_scheduler, {}  # type: Any, dict[str, Any]
    for key in keys:
        ts = s.tasks.get(key)
        if ts is None:
            out[key] = {"state": "(not on the scheduler)"}
            continue
        out[key] = {
            "state": ts.state,
            "resource_restrictions": ts.resource_restrictions,
            "worker_restrictions": sorted(ts.worker_restrictions or ()),
            "processing_on": ts.processing_on.name if ts.processing_on else None,
            "unrunnable": ts in s.unrunnable,
            "waiting_on": sorted(str(d.key) for d in ts.waiting_on or ()),
            "annotations": sorted(ts.annotations or ()),
            "workers": {str(w.name): dict(w.resources) for w in s.workers.values()},
        }
    return out


def _worker_view(keys: list[str], dask_worker: Any = None) -> dict[str, str]:
    """The worker's state of each of ``keys`` it knows."""
    return {k: dask_worker.state.tasks[k].state for k in keys if k in dask_worker.state.tasks}


def events(client: Client) -> dict[str, Any]:
    """accelsched's events of the run counted: actions, tasks fallen back (a burst event
    stands for ``count``), restarts by reason, and the rarer decisions whole."""
    logged = [m for _, m in client.get_events("accelsched")]
    actions = Counter(m["action"] for m in logged)
    return {
        "actions": dict(actions),
        "fallback_tasks": sum(m.get("count", 1) for m in logged if m["action"] == "fallback"),
        "fallback_reasons": dict(
            Counter(m.get("reason") for m in logged if m["action"] == "fallback")
        ),
        "restarts": dict(Counter(m.get("reason") for m in logged if m["action"] == "restart")),
        "notable": [m for m in logged if m["action"] in NOTABLE][:20],
    }


def stuck_tasks(client: Client, keys: list[str]) -> dict[str, Any]:
    """Per key, the scheduler's view and each worker's state of the task, if it has one:
    enough to tell a task no worker was offered from one a worker holds and never ran."""
    view = client.run_on_scheduler(_scheduler_view, keys)
    on_workers = client.run(_worker_view, keys, on_error="return")
    for key, entry in view.items():
        entry["on_workers"] = {
            w: states[key]
            for w, states in on_workers.items()
            if isinstance(states, dict) and key in states
        }
    return view


def p99(values: list[float]) -> float:
    """The 99th percentile (nearest rank below): one slow task in a hundred is the tail."""
    return sorted(values)[int(0.99 * (len(values) - 1))] if values else float("nan")


def keep_logs(tmp: Path, out: Path) -> None:
    """The processes' logs next to the figures, when something went wrong."""
    logs = out / "soak-logs"
    logs.mkdir(parents=True, exist_ok=True)
    for log in tmp.glob("*.log"):
        (logs / log.name).write_bytes(log.read_bytes())
