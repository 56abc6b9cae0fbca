"""``python -m benchmarks [--quick] [--out DIR] [NAME ...]``: run benchmarks, keep figures.

Each named benchmark (all of :data:`benchmarks.NAMES` by default) runs in turn; its
figures go to ``DIR/NAME.json`` and its plots to ``DIR/NAME*.png``. ``--quick`` runs each
on a smaller workload (every benchmark states what it shrinks), for CI and a first look.
Nothing here asserts a timing: the figures are read, not tested.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import time
from pathlib import Path
from typing import Any

from benchmarks import NAMES

DEFAULT_OUT = Path(__file__).parent / "results"


def _jsonable(value: Any) -> Any:
    """Figures as JSON: NaN and infinities become null, tuples lists."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def run_one(name: str, quick: bool, out: Path) -> dict[str, Any]:
    """Run ``benchmarks.bench_<name>`` and write ``out/<name>.json``."""
    module = importlib.import_module(f"benchmarks.bench_{name}")
    start = time.monotonic()
    figures = module.run(quick, out)
    figures = {"name": name, "quick": quick, **figures}
    (out / f"{name}.json").write_text(json.dumps(_jsonable(figures), indent=2) + "\n")
    print(f"{name}: done in {time.monotonic() - start:.1f} s -> {out / (name + '.json')}")
    return figures


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks", description=(__doc__ or "").splitlines()[0]
    )
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"among {', '.join(NAMES)}")
    parser.add_argument("--quick", action="store_true", help="small workloads (CI)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results folder")
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in NAMES]
    if unknown:
        parser.error(f"unknown benchmark(s) {', '.join(unknown)}; known: {', '.join(NAMES)}")
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.names or NAMES:
        run_one(name, args.quick, args.out)


if __name__ == "__main__":  # spawned worker processes re-import this module: no run there
    main()
