"""accelsched's benchmarks, run through one command line: ``python -m benchmarks NAME``.

Three kinds, one folder each, sharing :mod:`benchmarks.harness`:

- ``micro``: what one mechanism costs or how long it takes (the hot path, the overhead
  against plain distributed, a restart, how the scheduler's costs grow...): the figures
  a change to that mechanism moves.
- ``study``: how a policy behaves on a workload (leak handling against other policies,
  detection against leak size and on benign workloads, attribution): answers, not costs.
- ``gpu``: the costs on a real GPU (``benchmarks/gpu/``); it refuses to run without one
  unless ``--fake`` dry-runs it on simulated GPUs.

A benchmark is a module with ``run(quick: bool, out: pathlib.Path, ...) -> dict``: it
runs, draws its plots as ``out/<name>*.png`` and returns its figures, which the runner
writes to ``out/<name>.json`` with their provenance. Keyword parameters after ``out`` are
the command-line options it takes. It may also have ``unavailable(**options) -> str |
None``: a reason not to start on this machine, told before anything runs.
"""

from __future__ import annotations

import ast
import importlib.util
from dataclasses import dataclass

KINDS = ("micro", "study", "gpu")


@dataclass(frozen=True)
class Benchmark:
    name: str
    kind: str
    module: str

    def _source(self) -> ast.Module | None:
        """The module's source, parsed without importing it (an import would load
        distributed and matplotlib for a ``--help``)."""
        spec = importlib.util.find_spec(self.module)
        if spec is None or spec.origin is None:
            return None
        with open(spec.origin) as f:
            return ast.parse(f.read())

    def summary(self) -> str:
        """The module docstring's first line."""
        tree = self._source()
        doc = (ast.get_docstring(tree) or "").strip() if tree is not None else ""
        return doc.splitlines()[0] if doc else "(module missing)"

    def takes(self, option: str) -> bool:
        """Whether its ``run`` has the keyword ``option`` (a command-line option)."""
        tree = self._source()
        for node in tree.body if tree is not None else ():
            if isinstance(node, ast.FunctionDef) and node.name == "run":
                return any(a.arg == option for a in node.args.args + node.args.kwonlyargs)
        return False


def _micro(name: str) -> Benchmark:
    return Benchmark(name, "micro", f"benchmarks.micro.{name}")


def _study(name: str) -> Benchmark:
    return Benchmark(name, "study", f"benchmarks.studies.{name}")


#: Every benchmark, in the order ``python -m benchmarks`` runs them. They share one
#: process: the order is part of the setup (a later benchmark inherits what an earlier
#: one loaded, see the README's *Scale*), kept as the quoted figures were made.
REGISTRY: dict[str, Benchmark] = {
    b.name: b
    for b in (
        _micro("fallback"),
        _micro("guard"),
        _micro("restart"),
        _study("attribution"),
        _study("detection"),
        _study("leak"),
        _study("mixed_devices"),
        _micro("overhead"),
        _micro("hotpath"),
        _micro("scale"),
        _micro("placement_cost"),
        _study("soak"),
        _study("elastic"),
        Benchmark("gpu", "gpu", "benchmarks.gpu.costs"),
    )
}

#: What ``python -m benchmarks`` runs without a name: all but the real-GPU one, which
#: needs a GPU (or ``--fake``) and is asked for by name.
NAMES: tuple[str, ...] = tuple(n for n, b in REGISTRY.items() if b.kind != "gpu")
