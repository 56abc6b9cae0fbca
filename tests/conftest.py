from __future__ import annotations

from collections.abc import Generator, Iterator

import pytest

from accelsched.testing import FakeGPUs, fake_gpus
from tests.processes import REPORTS
from tests.utils import A100, H100

pytest_plugins = ["distributed.utils_test"]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator:
    """Keep each phase's report where the test's fixtures can read it (``REPORTS``)."""
    report = (yield).get_result()
    item.stash.setdefault(REPORTS, {})[report.when] = report


@pytest.fixture
def fake_gpus_2() -> Iterator[FakeGPUs]:
    """Two fake 16 GiB GPUs for this process and every process it starts."""
    with fake_gpus(count=2, memory="16GiB") as gpus:
        yield gpus


@pytest.fixture
def mixed_gpus() -> Iterator[FakeGPUs]:
    """An 80 GiB H100 (compute capability 9.0) and a 40 GiB A100 (8.0): devices that differ
    in every fact a requirement can name."""
    with fake_gpus(2, ["80GiB", "40GiB"], names=[H100, A100], capability=["9.0", "8.0"]) as g:
        yield g
