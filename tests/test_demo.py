"""The demo the README points to runs here, on simulated GPUs, and says what happened."""

from __future__ import annotations

import io
import re
import time

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


def test_events_cli_prints_what_happened(fake_gpus_2) -> None:
    from distributed import Client, LocalCluster

    import accelsched
    from accelsched.cli import main, print_events

    with (
        LocalCluster(
            n_workers=1, processes=True, dashboard_address=":0", resources={"GPU": 4}
        ) as cluster,
        Client(cluster) as client,
    ):
        accelsched.register(client)
        client.wait_for_workers(1)
        deadline = time.monotonic() + 15
        while not any(m["action"] == "gpu-corrected" for _, m in client.get_events("accelsched")):
            assert time.monotonic() < deadline, "no gpu-corrected event"
            time.sleep(0.05)
        out = io.StringIO()
        assert print_events(cluster.scheduler_address, ["gpu-corrected"], out) == 0
        assert "declared GPU=4, granted 2 (fewer-devices)" in out.getvalue()
        assert "[gpu-verified]" not in out.getvalue()
        assert main(["events", cluster.scheduler_address, "--action", "bogus"]) == 2


def test_events_cli_names_an_unreachable_scheduler(capsys) -> None:  # type: ignore[no-untyped-def]
    from accelsched.cli import main

    assert main(["events", "tcp://127.0.0.1:1", "--timeout", "1s"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot reach a scheduler at tcp://127.0.0.1:1" in err[0]
