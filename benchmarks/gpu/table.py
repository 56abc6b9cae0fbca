"""The GPU benchmark's short table (``gpu.txt``, also printed last): the figures a
reader of the device run's output tail needs, with ``n/a`` where a measurement failed."""

from __future__ import annotations

from typing import Any

from benchmarks.gpu.device import FAKE_LABEL, GiB, MiB


def table(result: dict) -> str:
    m = result["measurements"]
    rows: list[tuple[str, str, str]] = []

    def add(label: str, path: tuple[str, ...], unit: str, scale: float = 1.0) -> None:
        value: Any = m
        for part in path:
            if not isinstance(value, dict) or part not in value:
                rows.append((label, "n/a", unit))
                return
            value = value[part]
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            text = f"{value * scale:,.3f}".rstrip("0").rstrip(".") if scale != 1 else f"{value:,}"
        else:
            text = str(value)
        rows.append((label, text, unit))

    add(
        "guard GPU runner overhead (free every task)",
        ("guard_runner", "gpu_runner_free_every_task", "overhead_us"),
        "us/task",
    )
    add(
        "guard GPU runner overhead (no freeing)",
        ("guard_runner", "gpu_runner_no_freeing", "overhead_us"),
        "us/task",
    )
    add(
        "guard watcher overhead (CPU task, GPU worker)",
        ("guard_runner", "watch_runner_cpu_task", "overhead_us"),
        "us/task",
    )
    add(
        "tiny GPU task end to end, no plugins",
        ("cluster", "cluster_tasks", "without_plugins_us"),
        "us/task",
    )
    add(
        "tiny GPU task end to end, with plugins",
        ("cluster", "cluster_tasks", "with_plugins_us"),
        "us/task",
    )
    add(
        "tiny GPU task, with / without (paired median)",
        ("cluster", "cluster_tasks", "ratio", "median"),
        "x",
    )
    add(
        "tiny GPU task, GPU worker CPU, no plugins",
        ("cluster", "cluster_tasks", "worker_cpu_without_us"),
        "us/task",
    )
    add(
        "tiny GPU task, GPU worker CPU, with plugins",
        ("cluster", "cluster_tasks", "worker_cpu_with_us"),
        "us/task",
    )
    add(
        "tiny GPU task, worker CPU with / without (paired)",
        ("cluster", "cluster_tasks", "worker_cpu_ratio", "median"),
        "x",
    )
    add("NVMLMonitor.process_memory", ("nvml_query", "process_memory", "median_us"), "us/call")
    add(
        "GuardPlugin.check (one device)",
        ("guard_check", "check_one_device", "median_us"),
        "us/call",
    )
    add("free_all, 1 GiB cached in 1 block", ("free_all_blocks", "1x1GiB", "median_us"), "us")
    add("free_all, 1 GiB cached in 256 blocks", ("free_all_blocks", "256x4MiB", "median_us"), "us")
    add("free_all, nothing cached", ("free_all_blocks", "empty", "median_us"), "us")
    add(
        "NVML drop after free_all (1 GiB)",
        ("free_all_blocks", "1x1GiB", "nvml_drop_bytes"),
        "MiB",
        1 / MiB,
    )
    add("CUDA context baseline", ("context_baseline", "context", "bytes"), "MiB", 1 / MiB)
    add("after first kernel", ("context_baseline", "first_kernel", "bytes"), "MiB", 1 / MiB)
    add("after first cuBLAS call", ("context_baseline", "first_cublas", "bytes"), "MiB", 1 / MiB)
    add("context creation time", ("context_baseline", "context", "seconds"), "s")
    add("leak detection latency", ("cluster", "leak_and_restart", "detection_s"), "s")
    add("leak detection latency", ("cluster", "leak_and_restart", "detection_checks"), "checks")
    add(
        "restart request to GPUs verified",
        ("cluster", "leak_and_restart", "restart_to_ready_s"),
        "s",
    )
    add(
        "kept result survived the restart",
        ("cluster", "leak_and_restart", "kept_result_survived"),
        "",
    )
    env = result["environment"]
    head = [
        f"accelsched GPU benchmark: {env['label']}",
        "devices: "
        + (
            ", ".join(f"{d['name']} ({d['memory'] / GiB:.1f} GiB)" for d in env.get("devices", []))
            or "none"
        ),
    ]
    width = max(len(r[0]) for r in rows)
    lines = head + [f"{'':-<{width + 30}}"]
    lines += [f"{label:<{width}}  {value:>14}  {unit}" for label, value, unit in rows]
    if result["errors"]:
        lines.append("errors: " + ", ".join(sorted(result["errors"])) + " (see bench.json)")
    if env["mode"] == "fake":
        lines.append(f"*** {FAKE_LABEL} ***")
    return "\n".join(lines) + "\n"
