"""``python -m benchmarks [NAME ...] [--quick] [--out DIR]``: run benchmarks, keep figures.

Each named benchmark (all but ``gpu`` by default) runs in turn, in this process; its
figures go to ``DIR/NAME.json`` with their provenance (commit, versions, machine, load,
this command) and its plots to ``DIR/NAME*.png``. ``--quick`` runs each on a smaller
workload (every benchmark states what it shrinks), for CI and a first look. Nothing here
asserts a timing: the figures are read, not tested.

The options below ``--out`` belong to some benchmarks only (their ``run`` takes them); an
option given for a benchmark that does not take it is refused rather than ignored, so a
command never silently measures something other than what it says.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import KINDS, NAMES, REGISTRY
from benchmarks.harness.provenance import Provenance
from benchmarks.harness.results import write_result

DEFAULT_OUT = Path(__file__).parent / "results"
#: Exit status when a named benchmark cannot run on this machine (no GPU, say).
REFUSED = 3


#: Benchmark options: flag, dest, argparse keywords. Each is passed to ``run`` only when
#: given, as the keyword ``dest``.
def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive count")
    return value


OPTIONS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("--rounds", "rounds", {"type": _positive, "metavar": "N", "help": "paired rounds"}),
    ("--workers", "workers", {"type": _positive, "metavar": "N", "help": "one cluster size"}),
    ("--trials", "trials", {"type": _positive, "metavar": "N", "help": "leak trials"}),
    ("--duration", "duration", {"type": _positive, "metavar": "S", "help": "soak seconds"}),
    ("--seed", "seed", {"type": int, "metavar": "N", "help": "fault and load seed"}),
    ("--fake", "fake", {"action": "store_true", "help": "simulated GPUs: not GPU figures"}),
)


def listing() -> str:
    """Every benchmark by kind, with its one-line summary: ``--list`` and ``--help``."""
    lines = []
    for kind in KINDS:
        lines.append(f"{kind}:")
        for b in REGISTRY.values():
            if b.kind == kind:
                lines.append(f"  {b.name:<12} {b.summary()}")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Run accelsched's benchmarks: each writes OUT/NAME.json (its figures "
        "and their provenance) and OUT/NAME*.png.",
        epilog="benchmarks (without a NAME: every one but gpu):\n" + listing(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("names", nargs="*", metavar="NAME", help="default: all but gpu")
    p.add_argument("--quick", action="store_true", help="small workloads (CI)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results folder")
    p.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    group = p.add_argument_group("options of some benchmarks")
    for flag, dest, spec in OPTIONS:
        kwargs = dict(spec)
        default = False if kwargs.get("action") == "store_true" else None
        kwargs["help"] = f"{kwargs.get('help', '')} ({', '.join(_takers(dest)) or 'none'})"
        group.add_argument(flag, dest=dest, default=default, **kwargs)
    return p


def _takers(option: str) -> list[str]:
    return [name for name, b in REGISTRY.items() if b.takes(option)]


def _options(args: argparse.Namespace) -> dict[str, Any]:
    """The benchmark options given on this command line."""
    given = {dest: getattr(args, dest) for _, dest, _ in OPTIONS}
    return {k: v for k, v in given.items() if v is not None and v is not False}


def run_one(
    name: str, quick: bool, out: Path, options: dict[str, Any], command: list[str]
) -> dict[str, Any]:
    """Run one benchmark and write ``out/<name>.json``, its provenance included."""
    module = importlib.import_module(REGISTRY[name].module)
    record = Provenance(command)
    figures = module.run(quick, out, **options)
    path = out / f"{name}.json"
    result = write_result(path, name, REGISTRY[name].kind, quick, figures, record.finish())
    print(f"{name}: done in {result['provenance']['seconds']:.1f} s -> {path}", flush=True)
    return result


def _check(p: argparse.ArgumentParser, names: list[str], options: dict[str, Any]) -> None:
    """Refuse before anything runs: an option a benchmark does not take, or a benchmark
    that cannot run here (its ``unavailable`` gives the reason)."""
    for name in names:
        for dest in options:
            if not REGISTRY[name].takes(dest):
                flag = "--" + dest.replace("_", "-")
                p.error(f"{flag} is not an option of {name} (it is of: {', '.join(_takers(dest))})")
    for name in names:  # imported here, so a broken one fails before the first runs
        check = getattr(importlib.import_module(REGISTRY[name].module), "unavailable", None)
        reason = check(**options) if check is not None else None
        if reason:
            p.exit(REFUSED, f"{p.prog}: {name} refused: {reason}\n")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = parser()
    args = p.parse_args(argv)
    if args.list:
        print(listing())
        return 0
    unknown = [n for n in args.names if n not in REGISTRY]
    if unknown:
        p.error(f"unknown benchmark(s) {', '.join(unknown)}; known: {', '.join(REGISTRY)}")
    names = args.names or list(NAMES)
    options = _options(args)
    _check(p, names, options)
    args.out.mkdir(parents=True, exist_ok=True)
    command = ["python", "-m", "benchmarks", *argv]
    start = time.monotonic()
    failed = []
    for name in names:
        result = run_one(name, args.quick, args.out, options, command)
        if result.get("errors"):  # figures kept, but some measurement failed
            failed.append(name)
    if len(names) > 1:
        print(f"all done in {time.monotonic() - start:.1f} s -> {args.out}")
    if failed:
        print(f"errors in {', '.join(failed)}: see their JSON's 'errors'", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":  # spawned worker processes re-import this module: no run there
    sys.exit(main())
