"""Result files: one JSON per benchmark run, its figures and where they came from.

Written only here, so that every file has the same frame (``name``, ``kind``, ``quick``,
the figures, ``provenance``) and JSON that any reader accepts (no NaN).
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def jsonable(value: Any) -> Any:
    """Figures as strict JSON: NaN and infinities become null, tuples lists."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


def write_result(
    path: Path, name: str, kind: str, quick: bool, figures: dict[str, Any], provenance: dict
) -> dict[str, Any]:
    """Write ``path``; the figures come between the frame and the provenance, so that a
    reader sees what was measured before how."""
    result = {"name": name, "kind": kind, "quick": quick, **figures, "provenance": provenance}
    path.write_text(json.dumps(jsonable(result), indent=2, default=str) + "\n")
    return result


def spread(values: Iterable[float]) -> dict[str, float]:
    """Median, min and max: the figures every README table gives (no distributed
    import here: the GPU benchmark's image has only what it needs)."""
    v = list(values)
    if not v:
        return {"median": float("nan"), "min": float("nan"), "max": float("nan")}
    return {"median": statistics.median(v), "min": min(v), "max": max(v)}
