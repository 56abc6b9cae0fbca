"""Restarts from a warm fork server: nannies fork new worker processes (``fast_restart``).

The nannies of these tests live in the test process, so a spawned worker's parent is this
process and a forked one's is the fork server. What a forked worker must still have: the
simulated GPUs of the session now in effect, and no CUDA library imported before it
starts (a CUDA context does not survive ``fork``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace

import dask
import pytest
from distributed import Client, Nanny, Scheduler
from distributed.utils_test import gen_cluster, gen_test

import accelsched
from accelsched.internals import forkserver
from accelsched.testing import fake_gpus
from tests.utils import TWO_GPU_WORKERS, events, gpus, run_python, wait_for

#: A variable nothing reads: set, it changes the environment a fork server must match.
OTHER = "ACCELSCHED_TEST_UNREAD"

#: Libraries that create or need a CUDA context: none may be in a process that forks.
CUDA_LIBRARIES = ("cupy", "cupy_backends", "rmm", "numba", "cudf", "cuda", "torch", "cuml")

pytestmark = pytest.mark.skipif(not forkserver.available(), reason="no forkserver here")


def process_facts() -> dict:
    """In a worker: who started it, what it imported, which fake GPUs it sees."""
    import pynvml

    maps = Path("/proc/self/maps").read_text()
    return {
        "ppid": os.getppid(),
        "cuda_modules": sorted(m for m in sys.modules if m.split(".")[0] in CUDA_LIBRARIES),
        "libcuda": "libcuda.so" in maps,
        "fake_dir": os.environ.get("ACCELSCHED_FAKE_NVML_DIR"),
        "nvml_loaded": pynvml.nvmlLib is not None,
        "other": os.environ.get(OTHER),
    }


async def restarted(c, s, addr: str) -> str:  # type: ignore[no-untyped-def]
    """Restart the worker at ``addr`` through its nanny; the new address, GPUs verified."""
    before = set(s.workers)
    await c.restart_workers([addr])
    await wait_for(
        lambda: (
            len(s.workers) == len(before)
            and (new := set(s.workers) - before)
            and all(gpus(s, w) == 1 for w in new)
        ),
        timeout=30,
    )
    (new,) = set(s.workers) - before
    return new


@pytest.mark.usefixtures("fake_gpus_2")
@gen_cluster(client=True, Worker=Nanny, nthreads=TWO_GPU_WORKERS, timeout=60)
async def test_a_restarted_worker_is_forked_and_sees_its_gpus(c, s, a, b):
    await accelsched.register(c)
    await wait_for(lambda: all(gpus(s, w) == 1 for w in s.workers))
    assert dask.config.get(forkserver.METHOD_KEY) == "forkserver"
    first = (await c.run(process_facts, workers=[a.worker_address]))[a.worker_address]
    assert first["ppid"] == os.getpid()  # started before the plugin: spawned by its nanny
    verified = len(events(s, "gpu-verified"))
    new = await restarted(c, s, a.worker_address)
    facts = (await c.run(process_facts, workers=[new]))[new]
    assert facts["ppid"] != os.getpid()  # forked by the server
    assert facts["fake_dir"] == os.environ["ACCELSCHED_FAKE_NVML_DIR"]
    assert facts["cuda_modules"] == [] and not facts["libcuda"]
    # its simulated GPU verified again: NVML reached the forked process
    (again,) = [e for e in events(s, "gpu-verified")[verified:] if e["worker"] == new]
    assert again["granted"] == 1
    # a second restart is forked too
    newer = await restarted(c, s, new)
    assert (await c.run(os.getppid, workers=[newer]))[newer] == facts["ppid"]


@pytest.mark.usefixtures("fake_gpus_2")
@gen_cluster(client=True, Worker=Nanny, nthreads=TWO_GPU_WORKERS, timeout=60)
async def test_fast_restart_off_keeps_spawning(c, s, a, b):
    await accelsched.register(c, fast_restart=False)
    await wait_for(lambda: all(gpus(s, w) == 1 for w in s.workers))
    assert not s.nanny_plugins
    new = await restarted(c, s, a.worker_address)
    assert (await c.run(os.getppid, workers=[new]))[new] == os.getpid()


async def _one_session() -> dict:
    """A cluster of one nanny worker in the fake GPUs now in effect: restart it, and
    say what the forked process sees."""
    async with (
        Scheduler(dashboard_address=":0") as s,
        Nanny(s.address, nthreads=1, env={"CUDA_VISIBLE_DEVICES": "0"}) as n,
        Nanny(s.address, nthreads=1, env={"CUDA_VISIBLE_DEVICES": "1"}),
        Client(s.address, asynchronous=True) as c,
    ):
        await accelsched.register(c)
        await wait_for(lambda: len(s.workers) == 2 and all(gpus(s, w) == 1 for w in s.workers))
        new = await restarted(c, s, n.worker_address)
        facts = (await c.run(process_facts, workers=[new]))[new]
        facts["memory"] = [e for e in events(s, "gpu-verified") if e["worker"] == new][0][
            "devices"
        ][0]["memory"]
        return facts


@gen_test(timeout=120)
async def test_forked_workers_see_the_fake_gpus_of_the_session_now_in_effect():
    """A server started in an earlier ``fake_gpus`` session serves the next one: the
    session's variables reach forked workers through their nanny, and so do the new
    session's GPUs. Another variable changed since the server started starts it again."""
    with fake_gpus(count=2, memory="8GiB"):
        first = await _one_session()
        first_dir = os.environ["ACCELSCHED_FAKE_NVML_DIR"]
    assert first["fake_dir"] == first_dir and first["memory"] == 8 * 2**30
    # every nanny closed: the start method is back to what it was
    assert dask.config.get(forkserver.METHOD_KEY) != "forkserver"
    with fake_gpus(count=2, memory="4GiB"):
        second = await _one_session()
        assert second["fake_dir"] == os.environ["ACCELSCHED_FAKE_NVML_DIR"] != first_dir
    assert second["memory"] == 4 * 2**30 and second["ppid"] == first["ppid"]  # one server
    os.environ[OTHER] = "1"  # read by nothing: only the server's start sees it
    try:
        with fake_gpus(count=2, memory="2GiB"):
            third = await _one_session()
    finally:
        del os.environ[OTHER]
    assert third["memory"] == 2 * 2**30 and third["other"] == "1"
    assert third["ppid"] != first["ppid"]  # a new server, with the new environment


def test_a_nanny_hands_the_passed_variables_to_its_workers_and_takes_them_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What the plugin adds to a nanny's ``env`` (a stand-in with the ``env`` of
    distributed's ``Nanny``: no process starts here): the passed variables set now, never
    over the nanny's own, anew at a second setup, gone at teardown where unchanged."""
    nanny = SimpleNamespace(env={"ACCELSCHED_NVML_BACKEND": "mine", "OMP_NUM_THREADS": "1"})
    for name in forkserver.PASSED:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ACCELSCHED_FAKE_NVML_DIR", "/a")
    monkeypatch.setenv("ACCELSCHED_NVML_BACKEND", "env's")
    monkeypatch.setenv(OTHER, "1")
    forkserver._hand_over(nanny)
    assert nanny.env == {
        "ACCELSCHED_NVML_BACKEND": "mine",
        "OMP_NUM_THREADS": "1",
        "ACCELSCHED_FAKE_NVML_DIR": "/a",
    }
    monkeypatch.setenv("ACCELSCHED_FAKE_NVML_DIR", "/b")
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "t")
    forkserver._hand_over(nanny)  # set up again, later: the values now in effect
    assert nanny.env["ACCELSCHED_FAKE_NVML_DIR"] == "/b" and nanny.env["PYTEST_CURRENT_TEST"] == "t"
    nanny.env["PYTEST_CURRENT_TEST"] = "its own now"
    forkserver._hand_over(nanny)  # a value the nanny changed is its own
    assert nanny.env["PYTEST_CURRENT_TEST"] == "its own now"
    monkeypatch.delenv("ACCELSCHED_FAKE_NVML_DIR")
    forkserver._hand_over(nanny)  # unset now: not handed on
    assert "ACCELSCHED_FAKE_NVML_DIR" not in nanny.env
    monkeypatch.setenv("ACCELSCHED_FAKE_NVML_DIR", "/c")
    forkserver._hand_over(nanny)
    forkserver.FastRestart().teardown(nanny)
    assert nanny.env == {
        "ACCELSCHED_NVML_BACKEND": "mine",
        "OMP_NUM_THREADS": "1",
        "PYTEST_CURRENT_TEST": "its own now",
    }


def test_the_passed_variables_are_the_fake_gpus_sessions() -> None:
    """Every variable a ``fake_gpus`` session sets is passed but ``LD_LIBRARY_PATH``,
    which the loader reads once, at the process's start."""
    from accelsched.testing import _ENV_KEYS

    assert set(_ENV_KEYS) - {"LD_LIBRARY_PATH"} <= set(forkserver.PASSED)
    assert "LD_LIBRARY_PATH" not in forkserver.PASSED


def test_the_fork_server_imports_no_cuda_library() -> None:
    """What the server preloads (distributed's list and accelsched's) imports no CUDA
    library and loads no NVML: nothing there can create a CUDA context before a fork."""
    code = (
        "import importlib, sys\n"
        "from accelsched.internals import forkserver\n"
        "from distributed.versions import optional_packages, required_packages\n"
        "for m in ['distributed', *required_packages, *optional_packages,"
        " *forkserver.PRELOAD]:\n"
        "    try:\n"
        "        importlib.import_module(m)\n"
        "    except ImportError:\n"
        "        pass\n"
        "import pynvml\n"
        f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {CUDA_LIBRARIES!r})\n"
        "maps = open('/proc/self/maps').read()\n"
        "print(bad, 'libcuda.so' in maps, pynvml.nvmlLib is not None)\n"
    )
    out = run_python(code, timeout=120)
    assert out.split("\n")[0] == "[] False False", out
