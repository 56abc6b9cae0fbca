"""accelsched's benchmarks: one entry point, ``python -m benchmarks [--quick] [NAME ...]``.

Every benchmark is a module ``benchmarks/bench_<name>.py`` exposing
``run(quick: bool, out: pathlib.Path) -> dict``: it runs, draws its plots as
``out/<name>*.png`` and returns its figures, which the runner writes to
``out/<name>.json``. ``NAMES`` lists them in the order ``python -m benchmarks`` runs them.
"""

from __future__ import annotations

from pathlib import Path

#: The order ``python -m benchmarks`` runs them in; a name whose module is absent is skipped.
ORDER = (
    "fallback",
    "guard",
    "restart",
    "attribution",
    "detection",
    "leak",
    "overhead",
    "hotpath",
    "scale",
)
NAMES: tuple[str, ...] = tuple(
    n for n in ORDER if (Path(__file__).parent / f"bench_{n}.py").exists()
)
