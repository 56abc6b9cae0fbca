"""The ``/accelsched`` page on the scheduler's dashboard, loaded in headless Chromium.

A live cluster of named nannies on fake GPUs: one worker leaks past the threshold and is
restarted, the other leaks below it (an estimate to draw), and a GPU task no worker can
take falls back to CPU. The page is then opened in Debian's chromium through selenium and
must show the live figures: worker names, GPU names and UUIDs in the table, the counts in
the summary, drawn canvases. The browser test skips only when no chromium is installed
(``.ci/run`` installs it). Set ``ACCELSCHED_DASHBOARD_SCREENSHOT=docs/img/dashboard.png``
to refresh the screenshot in the docs.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
import urllib.request
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import dask
import pytest
from distributed import Scheduler
from distributed.utils_test import gen_cluster

import accelsched
from accelsched import display
from accelsched.testing import device_alloc
from tests.browser import chromium, needs_chromium
from tests.utils import (
    NAMES,
    MiB,
    events,
    leak_and_restart,
    named_nannies,
    status_snapshot,
    wait_for,
)

pytestmark = pytest.mark.usefixtures("fake_gpus_2")

DASHBOARD = {"dashboard": True, "dashboard_address": "127.0.0.1:0"}

#: Text of the page and of every shadow root under it (Bokeh 3 draws into shadow DOM),
#: and how many canvases have a pixel drawn.
PAGE_STATE_JS = """
const texts = [document.body ? document.body.innerText : ""];
let canvases = 0, drawn = 0;
function walk(root) {
  for (const el of root.querySelectorAll("*")) {
    if (el.shadowRoot) { texts.push(el.shadowRoot.textContent); walk(el.shadowRoot); }
    if (el.tagName === "CANVAS" && el.width > 0 && el.height > 0) {
      canvases++;
      const ctx = el.getContext("2d");
      if (ctx) {
        const d = ctx.getImageData(0, 0, el.width, el.height).data;
        for (let i = 3; i < d.length; i += 4) { if (d[i] > 0) { drawn++; break; } }
      }
    }
  }
}
walk(document);
return {text: texts.join("\\n"), canvases: canvases, drawn: drawn};
"""


def small_leak(i: int) -> int:
    device_alloc(128 * MiB, leak=True)  # under the 256 MiB threshold: drawn, not acted on
    return i


def cpu_or_gpu(x: int) -> int:
    return x + 1


def page_url(s: Scheduler) -> str:
    return f"http://127.0.0.1:{s.http_server.port}/{display.PAGE}"


def load_in_chromium(url: str, expected: list[str], screenshot: Path) -> dict[str, Any]:
    """Open ``url`` headless until every ``expected`` text shows and a canvas is drawn;
    save a screenshot. Blocking: run it in a thread while the scheduler serves."""
    with chromium() as driver:
        driver.get(url)
        deadline = time.monotonic() + 60
        state: dict[str, Any] = {}
        while time.monotonic() < deadline:
            state = driver.execute_script(PAGE_STATE_JS)
            if all(t in state["text"] for t in expected) and state["drawn"] >= 2:
                break
            time.sleep(0.5)
        time.sleep(1.5)  # one more refresh, so the screenshot shows the lines
        driver.save_screenshot(str(screenshot))
        state = driver.execute_script(PAGE_STATE_JS)
        state["title"] = driver.title
        return state


@needs_chromium
@gen_cluster(client=True, nthreads=[], scheduler_kwargs=DASHBOARD, timeout=180)
async def test_page_renders_live_cluster_in_chromium(c, s):
    async with AsyncExitStack() as stack:
        alpha, beta = await named_nannies(stack, s)
        await leak_and_restart(c, s, alpha)
        with dask.annotate(resources={"GPU": 1}):
            await c.submit(small_leak, 1, key="small-leak-1", workers=[beta.worker_address])
        with dask.annotate(resources={"GPU": 2}, fallback_timeout="0.5s"):
            assert await c.submit(cpu_or_gpu, 1, key="too-big") == 2  # no worker has 2
        await wait_for(lambda: events(s, "fallback"))

        def beta_estimate_drawn() -> bool:
            """beta's small leak reached the history"""
            return any(
                name == "beta" and any((x.estimate or 0) >= 128 * MiB for x in series)
                for (name, _), series in snapshot_series(s).items()
            )

        await wait_for(beta_estimate_drawn, timeout=30)
        snap = status_snapshot(s)
        uuids = [d["uuid"] for w in snap["workers"] for d in w["devices"]]
        gpu_name = snap["workers"][0]["devices"][0]["name"]
        shot = Path(os.environ.get("ACCELSCHED_DASHBOARD_SCREENSHOT") or tempfile.mktemp(".png"))
        expected = [*NAMES, gpu_name, *uuids, "1 restarts, 1 leaks, 0 reclaimed, 1 fallbacks"]
        state = await asyncio.to_thread(load_in_chromium, page_url(s), expected, shot)

    assert state["title"] == "Dask: accelsched"
    missing = [t for t in expected if t not in state["text"]]
    assert not missing, f"not on the page: {missing}"
    assert state["canvases"] >= 2 and state["drawn"] >= 2  # both charts drew something
    assert shot.stat().st_size > 10_000


def snapshot_series(s: Scheduler) -> dict:
    return s.plugins["accelsched-placement"].status_history.series


@gen_cluster(
    client=True,
    nthreads=[],
    scheduler_kwargs={**DASHBOARD, "preload": ["accelsched"]},
    timeout=60,
)
async def test_page_installed_at_scheduler_start_once(c, s):
    """``dask scheduler --preload accelsched`` (here in-process) adds the page as the
    scheduler starts; registering again, or installing again, adds no second one."""
    html = await asyncio.to_thread(urllib.request.urlopen, page_url(s))
    body = html.read()
    # a Bokeh session whose document our page function built (an error there is a 500)
    assert html.status == 200 and b'"roots":{"p' in body and b'"use_for_title":true' in body
    apps = len(s.http_application.applications)
    await accelsched.register(c)
    with pytest.warns(UserWarning, match="overwriting"):  # a new instance replaces it
        await c.register_plugin(accelsched.PlacementPlugin())
    assert display.install(s) is True
    assert len(s.http_application.applications) == apps
    assert display.status_history_of(s) is s.plugins["accelsched-placement"].status_history
    status = await asyncio.to_thread(
        urllib.request.urlopen, page_url(s).replace("accelsched", "status")
    )
    assert b'href="accelsched"' in status.read()  # a tab on distributed's own pages


@gen_cluster(client=True, nthreads=[])
async def test_no_dashboard_no_page(c, s):
    await accelsched.register(c)
    assert display.install(s) is False
    assert status_snapshot(s)["workers"] == []  # the status handler works without a dashboard
