"""What a result was measured on: code, versions, machine and command, in every result file.

A figure without its commit, its versions and the machine's load cannot be compared with
the next run's, and the README's tables have been reconstructed by hand from notes. The
runner (``python -m benchmarks``) takes a :class:`Provenance` as each benchmark starts and
writes :meth:`Provenance.finish` into that benchmark's JSON, so no benchmark can forget it.

Only the standard library is used: the GPU image runs this with what it holds (no psutil,
no matplotlib), and a checkout copied without its ``.git`` still gets a record (with the
commit unknown and why).
"""

from __future__ import annotations

import contextlib
import importlib.metadata as metadata
import importlib.util
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

#: Import names whose versions decide a figure; cupy only where it is importable.
PACKAGES = ("accelsched", "dask", "distributed", "numpy", "pynvml", "cupy")


def git_state(root: Path = ROOT) -> dict[str, Any]:
    """The checkout's commit and whether it differs from it (untracked files included:
    a new module changes what runs as much as an edited one)."""

    def git(*args: str) -> str:
        done = subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30
        )
        if done.returncode:
            raise RuntimeError(done.stderr.strip() or f"git {args[0]} exited {done.returncode}")
        return done.stdout

    try:
        commit = git("rev-parse", "HEAD").strip()
        changed = [line for line in git("status", "--porcelain").splitlines() if line]
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as exc:
        return {"commit": None, "dirty": None, "error": f"{type(exc).__name__}: {exc}"}
    return {"commit": commit, "dirty": bool(changed), "changed_paths": len(changed)}


def versions() -> dict[str, Any]:
    """Version of the distribution providing each of :data:`PACKAGES`, by import name
    (None: not importable); ``distributions`` names those installed under another name
    (``pynvml`` from ``nvidia-ml-py``, ``cupy`` from ``cupy-cuda12x``...).

    accelsched's is the imported module's own (the tree on ``PYTHONPATH`` may not be the
    installed one) with where it came from. Nothing is imported to learn a version: cupy
    would start loading CUDA libraries in the runner's process.
    """
    providers = metadata.packages_distributions()
    out: dict[str, Any] = {}
    renamed: dict[str, str] = {}  # import name -> its distribution's, where they differ
    for name in PACKAGES:
        out[name] = None
        if importlib.util.find_spec(name) is None:
            continue
        for dist in sorted(providers.get(name, ())):
            with contextlib.suppress(metadata.PackageNotFoundError):
                out[name] = metadata.version(dist)
                if dist != name:
                    renamed[name] = dist
                break
        out[name] = out[name] or "unknown"
    import accelsched

    out["accelsched"] = getattr(accelsched, "__version__", out["accelsched"])
    renamed.pop("accelsched", None)
    out["distributions"] = renamed
    out["accelsched_from"] = str(Path(accelsched.__file__ or "").parent)
    return out


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "Model")):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _memory_bytes() -> int | None:
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    with contextlib.suppress(AttributeError, ValueError, OSError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return None


def load_average() -> list[float] | None:
    """1, 5 and 15 minute load averages: on a shared machine, the context of every timing."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def machine() -> dict[str, Any]:
    usable = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    return {
        "cpus": os.cpu_count(),
        "cpus_usable": len(usable) if usable is not None else None,
        "cpu_model": _cpu_model(),
        "memory_bytes": _memory_bytes(),
        "os": platform.platform(),
        "python": f"{platform.python_implementation()} {platform.python_version()}",
    }


class Provenance:
    """Taken as a benchmark starts; :meth:`finish` adds the end's load and the duration."""

    def __init__(self, command: Sequence[str]) -> None:
        self.command = list(command)
        self.started = time.time()
        self._t0 = time.monotonic()
        self.load_start = load_average()
        self.git = git_state()
        self.versions = versions()
        self.machine = machine()

    def finish(self) -> dict[str, Any]:
        return {
            "git": self.git,
            "versions": self.versions,
            "machine": {
                **self.machine,
                "load_average": {"start": self.load_start, "end": load_average()},
            },
            "command": shlex.join(self.command),
            "executable": sys.executable,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(self.started)),
            "seconds": round(time.monotonic() - self._t0, 2),
        }
