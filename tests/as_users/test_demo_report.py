"""The demo's report as a reader sees it: a worker's line breaks where it restarted, each
mark sits where its event happened, fallbacks decided together are one mark with their
count, the chart takes the page's width (rendered in headless Chromium), and the demo
says plainly which NVML it runs on."""

from __future__ import annotations

import io
import math
import time
from pathlib import Path
from typing import Any

import pytest

from accelsched.demo.chart import TOGETHER, lines, marks, write_report
from accelsched.demo.memory import Sample, Sampler
from tests.browser import chromium, needs_chromium

MiB = 2**20
START = 1_000_000.0  # the time stamp the chart's 0 is


def restarted_gpu0() -> list[Sample]:
    """gpu-0 holds 1600 MiB in process 100 until t=5, restarts, and its successor
    (process 200) holds 300 MiB from t=8; gpu-1 holds 500 MiB throughout."""
    old = [Sample(t / 2, "gpu-0", 1600 * MiB, 100) for t in range(11)]
    new = [Sample(8 + t / 2, "gpu-0", 300 * MiB, 200) for t in range(5)]
    other = [Sample(t / 2, "gpu-1", 500 * MiB, 300) for t in range(21)]
    return old + new + other


def test_a_line_breaks_where_its_process_changed() -> None:
    drawn = lines(restarted_gpu0())
    ts, mib = drawn["gpu-0"]
    gap = [i for i, m in enumerate(mib) if math.isnan(m)]
    assert gap == [11]  # one break, between t=5 (the old process) and t=8 (the new)
    assert ts[10:13] == [5.0, 6.5, 8.0] and mib[10] == 1600 and mib[12] == 300
    assert not any(math.isnan(m) for m in drawn["gpu-1"][1])  # no restart: no break
    assert ts == sorted(ts)


def test_marks_sit_on_the_figure_the_event_saw_and_fallbacks_together_are_counted() -> None:
    samples = [
        Sample(0.0, "gpu-0", 300 * MiB, 100),
        Sample(2.0, "gpu-0", 1836 * MiB, 100),  # the leak: the spike
        Sample(2.2, "gpu-0", 1836 * MiB, 100),
    ]
    names = {"tcp://w0": "gpu-0"}
    leak = {"action": "leak", "worker": "tcp://w0", "device": 0, "nbytes": 1536 * MiB}
    leak.update(threshold=1024 * MiB, checks=2, prefixes=["leaky"], attributed={})
    leak.update(unexplained=0, reclaimed=0)
    fallback = {"action": "fallback", "key": "k", "waited": 1.0, "reason": "timeout"}
    events: list[tuple[float, dict[str, Any]]] = [(START + 2.1, leak)]
    events += [(START + 10 + i * 0.01, {**fallback, "key": f"k{i}"}) for i in range(6)]
    events += [(START + 10 + TOGETHER + 1, {**fallback, "key": "k6"})]
    got = marks(samples, events, names, START)
    assert got["leak"]["t"] == [pytest.approx(2.1)]
    assert got["leak"]["mib"] == [1836]  # on the spike, not before it
    fell = got["fallback"]
    assert fell["count"] == [6, 1] and sum(fell["count"]) == 7  # every fallback counted
    assert fell["label"] == [" 6", ""]
    assert fell["what"][0].startswith("6 tasks fell back within")
    assert fell["mib"] == [0.0, 0.0] and fell["worker"] == ["scheduler", "scheduler"]


def test_samples_are_timed_when_the_worker_read_them() -> None:
    """Not when the reply arrived: a busy worker answers late, and its figure would be
    drawn late, after the mark of the event that saw it."""

    class Client:
        def run(self, fn: Any, on_error: str) -> dict[str, tuple[str, int, float, int]]:
            time.sleep(0.2)  # the reply is slow
            return {"tcp://w0": ("gpu-0", 100, START + 1.0, 5 * MiB)}

    sampler = Sampler(Client(), START)  # type: ignore[arg-type]
    sampler.sample()
    assert sampler.samples == [Sample(1.0, "gpu-0", 5 * MiB, 100)]


#: Where the report's chart is drawn in the page, and its pixels: for each time asked
#: about, how many pixels of the named line's colour its column holds in the frame. The
#: line is antialiased over a white background: a pixel of it is the colour blended
#: with white, by the same amount in every channel (a grey grid line is not).
LINE_PIXELS_JS = """
const [name, times] = arguments;
if (!window.Bokeh || !Bokeh.documents.length) return null;
const doc = Bokeh.documents[0];
const fig = doc.get_model_by_name("device-memory");
const line = doc.get_model_by_name(name);
const view = fig && Bokeh.index.find_one(fig);
if (!view || !line) return null;
const colour = line.glyph.line_color;
const hex = typeof colour === "string" ? colour : colour.value;
const rgb = [1, 3, 5].map(i => parseInt(hex.slice(i, i + 2), 16));
const canvases = [];
(function walk(root) {
  for (const el of root.querySelectorAll("*")) {
    if (el.shadowRoot) walk(el.shadowRoot);
    if (el.tagName === "CANVAS" && el.width > 0) canvases.push(el);
  }
})(document);
const {top, bottom} = view.frame.bbox;
const counts = times.map(t => {
  const sx = view.frame.x_scale.compute(t);
  let n = 0;
  for (const c of canvases) {
    const ratio = c.width / c.getBoundingClientRect().width;
    const x = Math.round(sx * ratio);
    const y0 = Math.round(top * ratio), h = Math.round((bottom - top) * ratio);
    const d = c.getContext("2d").getImageData(x, y0, 1, h).data;
    for (let i = 0; i < d.length; i += 4) {
      const amounts = [0, 1, 2].filter(k => 255 - rgb[k] > 50)
        .map(k => (255 - d[i + k]) / (255 - rgb[k]));
      const low = Math.min(...amounts), high = Math.max(...amounts);
      if (d[i + 3] > 200 && low > 0.3 && high - low < 0.15) n++;
    }
  }
  return n;
});
return {counts: counts, width: view.bbox.width, page: document.documentElement.clientWidth};
"""


@needs_chromium
def test_the_report_shows_a_restart_as_a_break_in_chromium(tmp_path: Path) -> None:
    restart = {"action": "restart", "worker": "tcp://w0", "reason": "leak"}
    report = write_report(
        tmp_path / "report.html",
        restarted_gpu0(),
        [(START + 5.2, restart)],
        {"tcp://w0": "gpu-0"},
        START,
        note="a restart",
    )
    with chromium(width=1400, height=1000) as driver:
        driver.get(report.as_uri())
        deadline = time.monotonic() + 60
        state = None
        while time.monotonic() < deadline:
            # t=3: the old process's line; t=6.2, 7.4: the restart's gap; t=9: the new
            state = driver.execute_script(LINE_PIXELS_JS, "memory gpu-0", [3, 6.2, 7.4, 9])
            if state and state["counts"][0] and state["counts"][3]:
                break
            time.sleep(0.5)
        driver.save_screenshot(str(tmp_path / "report.png"))
    assert state, "the report's chart was not drawn"
    before, gap_a, gap_b, after = state["counts"]
    assert before > 0 and after > 0, state  # the line is drawn on both sides
    assert gap_a == 0 and gap_b == 0, state  # and nothing across the restart
    assert state["width"] >= 0.9 * state["page"], state  # the chart uses the page


def test_without_a_compiler_the_demo_says_it_runs_on_the_stand_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from accelsched import demo
    from accelsched.devices import NVMLMonitor
    from accelsched.testing import FakeNVMLWarning

    if NVMLMonitor(env={}).devices():
        pytest.skip("NVML sees real GPUs here: the demo uses them")
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("ACCELSCHED_CACHE_DIR", str(tmp_path / "cache"))
    out = io.StringIO()
    with pytest.warns(FakeNVMLWarning, match="stand-in"), demo._gpus(out):
        pass
    said = out.getvalue()
    assert "pure-Python stand-in for pynvml" in said, said
    assert "real pynvml" not in said, said
