"""``preimport``: a worker's modules whole before its first task (docs/reliability.md).

Two threads importing parts of ``dask.dataframe`` at once can be handed a partially
initialised module (a race in Python's import locks and dask's circular imports, not in
accelsched); the guard imports the package before the worker reads any task.
"""

from __future__ import annotations

import logging

import pytest
from distributed import Nanny
from distributed.utils_test import gen_cluster

import accelsched
from accelsched.worker.guard_plugin import preimport
from tests.utils import TWO_GPU_WORKERS, gpus, run_python, wait_for

pytestmark = pytest.mark.usefixtures("fake_gpus_2")

pytest.importorskip("pandas")

#: Ten threads import modules of dask.dataframe at once in a fresh process, after
#: ``preimport`` of the modules named in argv[1] (comma-separated, may be empty).
RACE = """
import importlib, sys, threading
from accelsched.worker.guard_plugin import preimport
preimport(tuple(m for m in sys.argv[1].split(",") if m))
mods = ["dask.dataframe.dask_expr._expr", "dask.dataframe", "dask.dataframe.methods",
        "dask.dataframe.dispatch", "dask.dataframe.backends", "dask.dataframe.dask_expr",
        "dask.dataframe.core", "dask.dataframe.io", "dask.dataframe.dask_expr._collection",
        "dask.dataframe.shuffle"]
barrier = threading.Barrier(len(mods))
errors = []
def go(name):
    barrier.wait()
    try:
        importlib.import_module(name)
    except BaseException as exc:
        errors.append(f"{name}: {type(exc).__name__}: {exc}")
threads = [threading.Thread(target=go, args=(m,)) for m in mods]
[t.start() for t in threads]
[t.join() for t in threads]
print(errors[0] if errors else "ok")
"""


def test_threads_importing_dask_dataframe_at_once_succeed_after_preimport() -> None:
    """The reproduction in docs/reliability.md (it fails in most fresh processes without
    ``preimport``: a ``_DeadlockError`` or a partially initialised module) passes every
    time once the package is whole."""
    for _ in range(3):
        assert run_python(RACE, "dask.dataframe") == "ok"


def test_a_module_that_is_not_installed_is_skipped(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="accelsched.worker.guard_plugin"):
        preimport(("no_such_module_here", "json"))
    assert "preimport no_such_module_here skipped" in caplog.text
    assert "preimported json in" in caplog.text  # the next one imported all the same


def test_bad_module_names_name_the_option() -> None:
    for bad in ([3], ["dask..dataframe"], [""], {"dask": 1}):
        with pytest.raises(ValueError, match=r"invalid preimport="):
            accelsched.GuardPlugin(preimport=bad)
    assert accelsched.GuardPlugin(preimport=[]).options["preimport"] == ()
    assert accelsched.GuardPlugin().options["preimport"] == ("dask.dataframe",)


def _imported() -> bool:
    import sys

    return "dask.dataframe" in sys.modules


@gen_cluster(client=True, Worker=Nanny, nthreads=TWO_GPU_WORKERS, timeout=60)
async def test_each_worker_has_dask_dataframe_before_its_first_task(c, s, a, b):
    """By default (``preimport: [dask.dataframe]``); a worker's process imports nothing
    of it otherwise (distributed does not)."""
    A, B = a.worker_address, b.worker_address
    assert await c.run(_imported) == {A: False, B: False}
    await accelsched.register(c)
    await wait_for(lambda: gpus(s, A) == 1 and gpus(s, B) == 1)
    assert await c.run(_imported) == {A: True, B: True}
