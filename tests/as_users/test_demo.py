"""The demo the README points to runs here, on simulated GPUs, and says what happened."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from accelsched.demo import STAGES, main
from accelsched.demo.chart import report_path
from tests.browser import CHROMIUM, chromium

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

    check_corrections_say_they_are_on_purpose(text)
    verified = check_verified_devices_are_labelled(text)
    check_two_workers_devices_are_told_apart(lines, verified)
    leak = re.search(r"\[leak\] (gpu-\d): device 0 leaks 1\.50 GiB", text)
    assert leak, text
    assert f"[restart] {leak.group(1)}: retired" in text
    assert f"only {leak.group(1)} restarted" in text
    assert "none recomputed" in text
    check_fallback_count_matches_the_rows(lines, text)
    assert "Same numbers on the GPU path and the fallback path." in text

    report = tmp_path / "accelsched-demo.html"
    assert lines[-1] == f"Report written to {report.resolve()}"
    page = report.read_text()
    for worker in ("gpu-0", "gpu-1", "cpu"):  # a memory line per worker
        assert f'"{worker}"' in page
    assert f'"{leak.group(1)}: retired' in page  # the restart marker's description
    assert '"restart"' in page and '"leak"' in page and '"fallback"' in page
    assert "<script" in page and "cdn.bokeh.org" not in page  # bokeh inline: opens offline
    check_timeline_starts_when_the_cluster_is_up(page)
    if CHROMIUM is not None:
        check_the_restart_is_a_break_in_chromium(report, leak.group(1))


def check_corrections_say_they_are_on_purpose(text: str) -> None:
    """The corrections are the point: no reader should hunt for a set-up error."""
    assert "the demo mis-declares 2 worker(s): cpu declares GPU=1 but has none; " in text
    assert "gpu-0 declares GPU=2 but has 1 GPU." in text
    assert "gpu-0: declared GPU=2, granted 1 (fewer-devices) - mis-declared on purpose" in text
    assert "cpu: declared GPU=1, granted 0 (no-devices) - mis-declared on purpose" in text


def check_verified_devices_are_labelled(text: str) -> dict[str, str]:
    """Each verified GPU by name and whole UUID, each figure labelled; worker -> UUID."""
    verified = dict(
        re.findall(
            r"\[gpu-verified\] (gpu-\d): verified 1 GPU\(s\): NVIDIA Simulated GPU, "
            r"UUID (GPU-[0-9a-f]{8}-[0-9a-f-]{27}), CUDA index 0$",
            text,
            re.MULTILINE,
        )
    )
    assert set(verified) == {"gpu-0", "gpu-1"}, text
    assert "0=GPU-" not in text
    return verified


def check_two_workers_devices_are_told_apart(lines: list[str], verified: dict[str, str]) -> None:
    """Stage 3: both workers call their GPU CUDA index 0; "ran on" tells the two apart."""
    placed = stage_table(lines, 3)
    assert {r["block"] for r in placed} == {str(b) for b in range(8)}, lines
    ran_on: dict[str, set[str]] = {}
    for r in placed:
        ran_on.setdefault(r["worker"], set()).add(r["ran on"])
        assert r["CUDA index"] == "0"
    assert set(ran_on) == {"gpu-0", "gpu-1"}, lines  # both GPUs used
    for worker, devices in ran_on.items():
        assert devices == {verified[worker][:12]}, lines
    assert ran_on["gpu-0"] != ran_on["gpu-1"]


def check_fallback_count_matches_the_rows(lines: list[str], text: str) -> None:
    """Stage 5: the rows are runs of tasks, and the count of fallbacks is read off them."""
    fell = re.search(r"^(\d+) of the (\d+) GPU tasks fell back to their CPU form", text, re.M)
    assert fell, text
    rows = stage_table(lines, 5)
    on_cpu = [r for r in rows if r["ran on"] == "CPU (fallback)"]
    assert len(on_cpu) == int(fell.group(1)), text
    assert len({r["block"] for r in rows}) == int(fell.group(2)) == 8, text
    again = [r for r in rows if r.get("note")]
    assert len(rows) == 8 + len(again), text  # a row per run: a block ran again
    for r in again:
        assert r["note"] == "its worker left while it ran: ran again" and r["ran on"] != "CPU"
        assert r["block"] in {c["block"] for c in on_cpu}  # and its second run is there


def check_timeline_starts_when_the_cluster_is_up(page: str) -> None:
    """No line for stage 1 (the start-up): the chart's 0 is after it."""
    assert "Time 0 is when the cluster was up" in page
    spans = [float(x) for x in re.findall(r'"name":"Span"[^}]*?"location":([-0-9.e]+)', page)]
    assert len(spans) == STAGES - 1 and min(spans) >= 0, spans


#: Per worker line of the report as the browser holds it: its points, and how many are
#: breaks (NaN: bokeh lifts the pen there).
LINES_JS = """
if (!window.Bokeh || !Bokeh.documents.length) return null;
const out = {};
for (const m of Bokeh.documents[0].all_models) {
  if (m.name && m.name.startsWith("memory ")) {
    const mib = Array.from(m.data_source.data.mib);
    out[m.name.slice(7)] = {points: mib.length, breaks: mib.filter(v => Number.isNaN(v)).length};
  }
}
return Object.keys(out).length ? out : null;
"""


def check_the_restart_is_a_break_in_chromium(report: Path, restarted: str) -> None:
    """The page as a reader opens it: the restarted worker's line is broken once (its
    old process, its new one), the others are whole."""
    with chromium() as driver:
        driver.get(report.as_uri())
        deadline = time.monotonic() + 60
        while not (drawn := driver.execute_script(LINES_JS)) and time.monotonic() < deadline:
            time.sleep(0.5)
    assert drawn, "the report's chart was not drawn"
    assert drawn[restarted]["breaks"] == 1, drawn
    assert all(v["breaks"] == 0 for k, v in drawn.items() if k != restarted), drawn


def stage_table(lines: list[str], stage: int) -> list[dict[str, str]]:
    """The rows of the table stage ``stage`` prints, by column heading."""
    start = next(i for i, line in enumerate(lines) if line.startswith(f"[{stage}/"))
    head = next(i for i in range(start, len(lines)) if lines[i].startswith("block  "))
    columns = re.split(r"\s{2,}", lines[head])
    rows: list[dict[str, str]] = []
    for line in lines[head + 2 :]:
        if not re.match(r"\d+  ", line):
            break
        rows.append(dict(zip(columns, re.split(r"\s{2,}", line), strict=False)))
    return rows


def test_the_report_goes_to_the_temporary_folder_by_default(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Not into the working directory, which is often a checkout: a stray file for git."""
    import tempfile

    import accelsched.demo

    project, temp = tmp_path / "project", tmp_path / "temp"
    project.mkdir()
    temp.mkdir()
    monkeypatch.chdir(project)
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    given: list[Path] = []
    monkeypatch.setattr(accelsched.demo, "run", lambda out, report: given.append(report) or 0)
    assert main(out=io.StringIO()) == 0
    assert given == [temp.absolute() / "accelsched-demo.html"]
    assert list(project.iterdir()) == []  # the writability check left nothing behind


@pytest.mark.parametrize("bad", ["report.png", "no-such-folder/report.html"])
def test_demo_refuses_a_report_path_it_cannot_write(tmp_path: Path, bad: str, capsys) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=re.escape(repr(str(tmp_path / bad)))):
        report_path(tmp_path / bad)
    assert main(str(tmp_path / bad), out=io.StringIO()) == 2  # before any cluster starts
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "invalid report path" in err[0]


def test_a_report_path_names_what_is_wrong_with_it(tmp_path: Path) -> None:
    """A file where a folder should be is said to be no folder (before: "does not
    exist", of a file that exists); an empty path is refused (before: the report went to
    the working directory without a word)."""
    (tmp_path / "a-file").write_text("")
    bad = str(tmp_path / "a-file" / "report.html")
    with pytest.raises(ValueError, match=re.escape(f"{str(tmp_path / 'a-file')!r} is no folder")):
        report_path(bad)
    for empty in ("", " "):
        with pytest.raises(ValueError, match="expected a .html file or a folder"):
            report_path(empty)


def test_a_report_path_that_is_a_fifo_or_a_link_is_said_or_written_through(
    tmp_path: Path, capsys
) -> None:  # type: ignore[no-untyped-def]
    """A FIFO named ``.html`` is no regular file: exit 2, one line (before: the check
    opened it and waited for a reader for ever); a link named ``.html`` is written
    through, whatever its target's name (before: resolved to ``target.txt`` and refused
    by the demo's second look with a traceback, exit 1)."""
    fifo = tmp_path / "report.html"
    os.mkfifo(fifo)
    assert main(str(fifo), out=io.StringIO()) == 2
    (err,) = capsys.readouterr().err.strip().splitlines()
    assert "it is no regular file" in err
    (tmp_path / "target.txt").write_text("")
    link = tmp_path / "link.html"
    link.symlink_to("target.txt")
    assert report_path(link) == link and report_path(report_path(link)) == link
    dangling = tmp_path / "dangling.html"
    dangling.symlink_to("nowhere.html")
    assert report_path(dangling) == dangling  # checked, and left as it was
    assert dangling.is_symlink() and not (tmp_path / "nowhere.html").exists()


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
