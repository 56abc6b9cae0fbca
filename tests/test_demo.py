"""The demo the README points to runs here, on simulated GPUs, and says what happened."""

from __future__ import annotations

import io
import re

from accelsched.demo import run


def test_demo_shows_placement_leak_and_fallback() -> None:
    out = io.StringIO()
    assert run(out) == 0
    text = out.getvalue()
    assert "declared GPU=2, granted 1 (fewer-devices)" in text
    assert "declared GPU=1, granted 0 (no-devices)" in text
    leak = re.search(r"\[leak\] (gpu-\d): device 0 leaks 1536 MiB", text)
    assert leak, text
    assert f"[restart] {leak.group(1)}: retired" in text
    assert f"only {leak.group(1)} restarted" in text
    assert "none recomputed" in text
    assert "CPU (fallback)" in text and "fell back to their CPU form" in text
    assert "Same numbers on the GPU path and the fallback path." in text
