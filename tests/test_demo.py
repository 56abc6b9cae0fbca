"""The demo the README points to runs here, on simulated GPUs, and says what happened."""

from __future__ import annotations

import io
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from accelsched.demo import STAGES, main
from accelsched.demo.chart import report_path

# A record from logging's or distributed's formatters, or a Python warning.
LOG_LINE = re.compile(
    r"(^\d{4}-\d\d-\d\d[ T][\d:,.]+ - )|( - (DEBUG|INFO|WARNING|ERROR) - )|Warning: "
)


def test_demo_shows_placement_leak_and_fallback_and_writes_its_report(tmp_path: Path) -> None:
    """The command the README gives, as a user runs it: every line it prints is its own."""
    proc = subprocess.run(
        [sys.executable, "-m", "accelsched", "demo", "--report", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stderr == ""
    text = proc.stdout
    lines = text.splitlines()
    assert not [line for line in lines if LOG_LINE.search(line)], text
    stages = [m.group(1) for line in lines if (m := re.match(r"\[(\d+)/(\d+)\] \S", line))]
    assert stages == [str(n) for n in range(1, STAGES + 1)], text

    assert "declared GPU=2, granted 1 (fewer-devices)" in text
    assert "declared GPU=1, granted 0 (no-devices)" in text
    leak = re.search(r"\[leak\] (gpu-\d): device 0 leaks 1536 MiB", text)
    assert leak, text
    assert f"[restart] {leak.group(1)}: retired" in text
    assert f"only {leak.group(1)} restarted" in text
    assert "none recomputed" in text
    assert "CPU (fallback)" in text and "fell back to their CPU form" in text
    assert "Same numbers on the GPU path and the fallback path." in text

    report = tmp_path / "accelsched-demo.html"
    assert lines[-1] == f"Report written to {report.resolve()}"
    page = report.read_text()
    for worker in ("gpu-0", "gpu-1", "cpu"):  # a memory line per worker
        assert f'"{worker}"' in page
    assert f'"{leak.group(1)}: retired' in page  # the restart marker's description
    assert '"restart"' in page and '"leak"' in page and '"fallback"' in page
    assert "<script" in page and "cdn.bokeh.org" not in page  # bokeh inline: opens offline


@pytest.mark.parametrize("bad", ["report.png", "no-such-folder/report.html"])
def test_demo_refuses_a_report_path_it_cannot_write(tmp_path: Path, bad: str, capsys) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=re.escape(repr(str(tmp_path / bad)))):
        report_path(tmp_path / bad)
    assert main(str(tmp_path / bad), out=io.StringIO()) == 2  # before any cluster starts
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "invalid report path" in err[0]


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
        assert print_events(cluster.scheduler_address, ["bogus"], out) == 2
        with pytest.raises(SystemExit) as usage:  # argparse's usage error, as for any option
            main(["events", cluster.scheduler_address, "--action", "bogus"])
        assert usage.value.code == 2


def test_events_cli_names_an_unreachable_scheduler(capsys) -> None:  # type: ignore[no-untyped-def]
    from accelsched.cli import main

    assert main(["events", "tcp://127.0.0.1:1", "--timeout", "1s"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot reach a scheduler at tcp://127.0.0.1:1" in err[0]


def test_the_demo_puts_logging_back_as_it_was(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The demo also runs inside other programs: its quieting ends with it."""
    import logging
    import os

    import dask

    from accelsched.demo.quiet import quiet_logs

    monkeypatch.delenv("DASK_LOGGING__DISTRIBUTED", raising=False)
    core = logging.getLogger("distributed.core")
    before = core.level
    core.setLevel(logging.INFO)
    with quiet_logs():
        assert core.level == logging.ERROR
        spawn = dask.config.get("distributed.nanny.pre-spawn-environ")
        assert spawn["DASK_LOGGING__DISTRIBUTED"] == "error"  # restarted workers too
        os.environ["DASK_LOGGING__DISTRIBUTED"] = "error"  # what a nanny's start does
    assert core.level == logging.INFO
    assert "DASK_LOGGING__DISTRIBUTED" not in os.environ
    assert "DASK_LOGGING__DISTRIBUTED" not in dask.config.get(
        "distributed.nanny.pre-spawn-environ", {}
    )
    core.setLevel(before)
