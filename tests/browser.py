"""Headless Chromium for the tests that look at a page as a reader does (Debian's
chromium and chromedriver, driven through selenium). Tests that need it skip only when
no chromium is installed (``.ci/run`` installs it)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

CHROMIUM = next(
    (p for p in (shutil.which("chromium"), "/usr/bin/chromium") if p and os.path.exists(p)),
    None,
)
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"

#: The mark for a test that needs the browser.
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium installed (apt-get install chromium)"
)


@contextmanager
def chromium(width: int = 1400, height: int = 1100) -> Iterator[Any]:
    """A headless chromium (a selenium driver) with a window ``width`` x ``height`` and a
    profile of its own, removed afterwards."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM or ""
    profile = tempfile.mkdtemp(prefix="accelsched-chromium-")
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--window-size={width},{height}",
        f"--user-data-dir={profile}",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)
