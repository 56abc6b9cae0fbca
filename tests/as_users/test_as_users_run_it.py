"""accelsched as users run it: every party a process of its own.

Users start ``dask scheduler --preload accelsched`` (or call ``accelsched.register`` on a
plain one), ``dask worker`` processes on their GPU machines, and drive the cluster from
a script or a notebook whose steps live in ``__main__``. In-process clusters share the
client's modules and hide what breaks there: a step the scheduler could not unpickle
("Can't get attribute 'normalise' on <module '__main__'>") passed every other test.

Here the scheduler and the workers are ``dask`` commands whose Python path holds the
library but neither the tests nor the client's folder; GPU workers run under
``accelsched simulate --gpus 1`` (each its own machine with one simulated GPU) and one
worker has no GPU. Clients are ``python pipeline.py`` and a notebook run by a Jupyter
kernel. The clusters start once for the module.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests import processes
from tests.processes import Process, running
from tests.utils import ACCELSCHED, FAST, ROOT, SIMULATE

#: The servers' Python path: the library, not the tests, not the client's folder.
SERVER_PATHS = [str(ROOT)]
#: The guard's options, as preload arguments and as ``register`` keywords: a leak of
#: 512 MiB is declared within a second.
GUARD = {**FAST, "check_interval": "200ms"}
#: Long enough that no strict task falls back on a slow machine; a step that must fall
#: back says so with its own timeout.
FALLBACK_TIMEOUT = "60s"
CLIENT_TIMEOUT = 90  # s a client process may run


@dataclass
class Cluster:
    """A running cluster: its address, its processes, where they log."""

    address: str
    folder: Path
    procs: list[Process]

    def logs(self) -> str:
        return "\n".join(f"--- {p.log.name}\n{p.output()[-2000:]}" for p in self.procs)


def start_cluster(folder: Path, gpu_workers: int, *scheduler_args: str) -> Iterator[Cluster]:
    """A scheduler, ``gpu_workers`` simulated one-GPU workers ``gpu-0``..., and ``cpu``.

    The processes run in ``folder``, which holds nothing a client writes."""
    sched = processes.scheduler(folder, *scheduler_args, paths=SERVER_PATHS, cwd=folder)
    with running(sched):
        address = processes.scheduler_address(folder / "scheduler.json", sched)
        workers = [
            processes.worker(
                folder, f"gpu-{i}", address, before=SIMULATE, paths=SERVER_PATHS, cwd=folder
            )
            for i in range(gpu_workers)
        ]
        workers.append(
            processes.worker(
                folder,
                "cpu",
                address,
                env={"CUDA_VISIBLE_DEVICES": ""},
                paths=SERVER_PATHS,
                cwd=folder,
            )
        )
        with running(*workers):
            yield Cluster(address, folder, [sched, *workers])


@pytest.fixture(scope="module")
def preloaded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """``dask scheduler --preload accelsched`` with its options as preload arguments."""
    options = [f"--{k.replace('_', '-')}={v}" for k, v in GUARD.items()]
    yield from start_cluster(
        tmp_path_factory.mktemp("preloaded"),
        2,
        "--preload",
        "accelsched",
        f"--fallback-timeout={FALLBACK_TIMEOUT}",
        *options,
    )


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A ``dask scheduler`` without accelsched: the client script registers it."""
    yield from start_cluster(tmp_path_factory.mktemp("plain"), 1)


# --- the client's code ----------------------------------------------------------------
#
# The same cells make the script (joined) and the notebook (one cell each). The first
# cell, written per run, says where the scheduler is.

SETUP = """\
import json
import time

import dask.array as da
import dask.dataframe as dd
import numpy as np
import pandas as pd
from distributed import Client, get_worker

import accelsched

client = Client(ADDRESS, timeout=30)
if REGISTER:
    accelsched.register(client, fallback_timeout=FALLBACK_TIMEOUT, **GUARD)
client.wait_for_workers(WORKERS, timeout=60)
names = {a: w["name"] for a, w in client.scheduler_info(n_workers=-1)["workers"].items()}


def verified():
    return {
        names.get(m["worker"])
        for _, m in client.get_events("accelsched")
        if m["action"] == "gpu-verified"
    }


deadline = time.monotonic() + 60
while verified() != GPU_WORKERS:
    assert time.monotonic() < deadline, f"verified: {verified()}"
    time.sleep(0.1)
"""

STEPS = '''\
def where():
    """(worker name, bound device or -1)."""
    device = accelsched.current_device()
    return get_worker().name, -1 if device is None else device


def gpu_form(block):  # the quick start's step: cupy on a GPU, numpy here
    xp = accelsched.array_module()
    return xp.asarray(block) * 2


def cpu_form(block):
    return block * 2


double = accelsched.dual(gpu_form, cpu_form)


@accelsched.gpu
def normalise(block):
    return block / 2


@accelsched.gpu
def placed(block):
    """One row per block: where its task ran."""
    name, device = where()
    return np.array([[int(name.rsplit("-", 1)[1]), device]])


@accelsched.gpu
def where_on_gpu():
    return where()


which_form = accelsched.dual(lambda: ("gpu", *where()), lambda: ("cpu", *where()))

clean = accelsched.dual(lambda part: part.dropna(), lambda part: part.dropna())


@accelsched.gpu
def features(part):
    name, device = where()
    return part.assign(worker=name, device=device)


@accelsched.gpu(count=2, fallback_timeout="500ms")  # no worker has two GPUs
def needs_two_gpus():
    return where()
'''

PIPELINE = """\
x = da.random.default_rng(0).random((2_000, 100), chunks=(500, 100))
y = x.map_blocks(double).map_blocks(normalise)
np.testing.assert_allclose(y.compute(), x.compute())
rows = x.map_blocks(double).map_blocks(placed, chunks=(1, 2), dtype=int).compute()
assert len(rows) == 4 and set(rows[:, 1]) == {0}, rows  # every task bound to its GPU

ddf = dd.from_pandas(pd.DataFrame({"a": np.arange(100.0)}), npartitions=4)
meta = ddf._meta.assign(worker="", device=0)  # features runs on workers only
frame = ddf.map_partitions(clean).map_partitions(features, meta=meta).compute()
assert frame["a"].tolist() == list(np.arange(100.0))

submitted = client.submit(where_on_gpu).result()
form = client.submit(which_form).result()

fallback = client.submit(needs_two_gpus)
fell_back = fallback.result(timeout=60)
fallbacks = [m for _, m in client.get_events("accelsched") if m["action"] == "fallback"]
assert any(m.get("key") == fallback.key for m in fallbacks), fallbacks

print(json.dumps({
    "blocks": [[f"gpu-{int(w)}", int(d)] for w, d in rows],
    "frame": sorted({(w, int(d)) for w, d in zip(frame["worker"], frame["device"])}),
    "submitted": list(submitted),
    "form": list(form),
    "fell_back": list(fell_back),
}))
"""

LEAK = """\
import os

from accelsched.testing import device_alloc

address = {name: a for a, name in names.items()}


def make(n):
    return np.arange(1_000) * n


@accelsched.gpu
def leaky(n):
    device_alloc(512 * 2**20, leak=True)  # never freed, like a forgotten CuPy array
    return n


pids = client.run(os.getpid)
on_leaker = client.submit(make, 1, workers=[address["gpu-0"]])
elsewhere = client.submit(make, 2, workers=[address["gpu-1"]])
client.gather([on_leaker, elsewhere])
assert client.submit(leaky, 3, workers=[address["gpu-0"]]).result() == 3


def restarts():
    return [m for _, m in client.get_events("accelsched") if m["action"] == "restart"]


deadline = time.monotonic() + 60
while not restarts():
    assert time.monotonic() < deadline, "no restart"
    time.sleep(0.1)
assert [names[m["worker"]] for m in restarts()] == ["gpu-0"], restarts()
assert on_leaker.result(timeout=30).tolist() == (np.arange(1_000) * 1).tolist()
assert elsewhere.result(timeout=30).tolist() == (np.arange(1_000) * 2).tolist()
client.wait_for_workers(3, timeout=60)
now_names = {a: w["name"] for a, w in client.scheduler_info(n_workers=-1)["workers"].items()}
now = {now_names[a]: pid for a, pid in client.run(os.getpid).items()}
before = {names[a]: pid for a, pid in pids.items()}
print(json.dumps({"before": before, "now": now}))
"""


def first_cell(cluster: Cluster, register: bool, gpu_workers: int) -> str:
    gpus = {f"gpu-{i}" for i in range(gpu_workers)}
    return (
        f"ADDRESS = {cluster.address!r}\nREGISTER = {register!r}\n"
        f"FALLBACK_TIMEOUT = {FALLBACK_TIMEOUT!r}\nGUARD = {GUARD!r}\n"
        f"WORKERS = {gpu_workers + 1}\nGPU_WORKERS = {gpus!r}\n"
    )


def run_script(folder: Path, cluster: Cluster, code: str) -> dict[str, object]:
    """``python pipeline.py`` in ``folder``, as a user runs it; its last line, as JSON."""
    (folder / "pipeline.py").write_text(code)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(SERVER_PATHS)}
    done = subprocess.run(
        [sys.executable, "pipeline.py"],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=CLIENT_TIMEOUT,
    )
    assert done.returncode == 0, f"{done.stderr[-4000:]}\n{cluster.logs()}"
    return dict(json.loads(done.stdout.splitlines()[-1]))


def check_placed(result: dict[str, object], gpu_workers: int) -> None:
    """Every marked step ran on a GPU worker, bound to its device; the step that could
    never be placed fell back to the host."""
    gpus = [f"gpu-{i}" for i in range(gpu_workers)]
    blocks = result["blocks"]
    assert isinstance(blocks, list) and len(blocks) == 4
    assert all(w in gpus and d == 0 for w, d in blocks), blocks
    frame = result["frame"]
    assert isinstance(frame, list) and frame
    assert all(w in gpus and d == 0 for w, d in frame), frame
    assert result["submitted"] in [[w, 0] for w in gpus]
    assert result["form"] in [["gpu", w, 0] for w in gpus]
    fell_back = result["fell_back"]
    assert isinstance(fell_back, list) and fell_back[1] == -1, fell_back  # no device held


# --- the tests ------------------------------------------------------------------------


def test_script_against_a_preloaded_scheduler(preloaded: Cluster, tmp_path: Path) -> None:
    code = "\n\n".join([first_cell(preloaded, False, 2), SETUP, STEPS, PIPELINE])
    check_placed(run_script(tmp_path, preloaded, code), 2)


def test_script_registering_on_a_plain_scheduler(plain: Cluster, tmp_path: Path) -> None:
    code = "\n\n".join([first_cell(plain, True, 1), SETUP, STEPS, PIPELINE])
    check_placed(run_script(tmp_path, plain, code), 1)


@pytest.fixture
def kernel_spec(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Jupyter kernel of this interpreter (the venv's), wherever Jupyter looks."""
    kernels = tmp_path_factory.mktemp("kernels")
    spec = kernels / "accelsched-tests"
    spec.mkdir()
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    kernel = {
        "argv": argv,
        "display_name": "accelsched tests",
        "language": "python",
        "env": {"PYTHONPATH": os.pathsep.join(SERVER_PATHS)},
    }
    (spec / "kernel.json").write_text(json.dumps(kernel))
    return kernels


def test_notebook_against_a_preloaded_scheduler(
    preloaded: Cluster, tmp_path: Path, kernel_spec: Path
) -> None:
    import nbformat
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    cells = [first_cell(preloaded, False, 2), SETUP, *STEPS.split("\n\n\n"), PIPELINE]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    specs = KernelSpecManager(kernel_dirs=[str(kernel_spec)])
    km = KernelManager(kernel_name="accelsched-tests", kernel_spec_manager=specs)
    runner = NotebookClient(
        nb, km=km, timeout=CLIENT_TIMEOUT, resources={"metadata": {"path": str(tmp_path)}}
    )
    try:
        runner.execute()
    except CellExecutionError as exc:
        raise AssertionError(f"{exc}\n{preloaded.logs()}") from None
    (stream,) = [o for o in nb.cells[-1].outputs if o.get("name") == "stdout"]
    check_placed(json.loads(stream["text"].splitlines()[-1]), 2)


def test_status_command_shows_the_verified_gpus(preloaded: Cluster) -> None:
    deadline = time.monotonic() + 60  # the workers may still be joining (run alone)
    while True:
        done = subprocess.run(
            [ACCELSCHED, "status", preloaded.address, "--timeout", "30s"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        lines = done.stdout.splitlines()
        joined = "3 workers, 2 verified GPUs, 0 quarantined" in lines[0]
        if joined or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert joined, f"{done.stdout}\n{preloaded.logs()}"
    assert lines[1].startswith(f"options: fallback_timeout={float(FALLBACK_TIMEOUT[:-1])}")
    rows = {line.split()[0]: line for line in lines[3:]}
    for name in ("gpu-0", "gpu-1"):
        assert "NVIDIA Simulated GPU" in rows[name] and "16.00 GiB" in rows[name], done.stdout


HOSTILE = """
import asyncio

import dask
from distributed.core import rpc

from accelsched.policy.marks import Mark

address = {name: a for a, name in names.items()}

def accelsched_events(action):
    return [m for _, m in client.get_events("accelsched") if m["action"] == action]


# one task asking for more GPUs than any worker can have: it falls back at once, and
# neither it nor its neighbour harms a worker (before: both workers were removed)
with dask.annotate(resources={"GPU": 2**64}, fallback_timeout="30s"):
    huge = client.submit(where, pure=False)
good = client.submit(where_on_gpu, pure=False)
assert huge.result(timeout=20)[1] == -1  # on the host, no device held
assert good.result(timeout=30)[0] in GPU_WORKERS
assert len(client.scheduler_info(n_workers=-1)["workers"]) == WORKERS
(fell,) = [e for e in accelsched_events("fallback") if e.get("key") == huge.key]
assert fell["reason"] == "unsatisfiable" and fell["waited"] < 15, fell

# a step whose mark is bad (unpickled data can say anything): that task errs alone
bad_step = accelsched.gpu(where)
bad_step.__accelsched_gpu__ = Mark(count=1, timeout=float("nan"), timeout_given=True)
try:
    client.submit(bad_step, pure=False).result(timeout=30)
    raise AssertionError("a NaN mark was taken")
except ValueError as exc:
    assert "fallback_timeout=nan" in str(exc), exc


# a drain order meant for another process (one that had this address before): refused
async def drain():
    async with rpc(address["gpu-1"]) as r:
        return [
            (await r.accelsched_drain(on=True, process=process))["status"]
            for process in ("", "Worker-gone")
        ]


assert asyncio.run(drain()) == ["refused", "refused"]
draining = client.run(
    lambda dask_worker: dask_worker.plugins["accelsched-guard"].inventory.draining,
    workers=[address["gpu-1"]],
)
assert draining == {address["gpu-1"]: False}, draining
assert client.submit(where_on_gpu, workers=[address["gpu-1"]], pure=False).result(30)[0] == "gpu-1"
print(json.dumps({"ok": True}))
"""


def test_one_task_or_caller_cannot_harm_the_cluster(preloaded: Cluster, tmp_path: Path) -> None:
    """Issue 17's cases on a command-line cluster: an unsatisfiable amount, a bad mark,
    a drain order meant for another process."""
    code = "\n\n".join([first_cell(preloaded, False, 2), SETUP, STEPS, HOSTILE])
    assert run_script(tmp_path, preloaded, code) == {"ok": True}


def test_a_leaking_step_restarts_only_its_worker_losing_nothing(
    preloaded: Cluster, tmp_path: Path
) -> None:
    """Last: it restarts ``gpu-0``."""
    code = "\n\n".join([first_cell(preloaded, False, 2), SETUP, LEAK])
    result = run_script(tmp_path, preloaded, code)
    before, now = result["before"], result["now"]
    assert isinstance(before, dict) and isinstance(now, dict)
    assert now["gpu-0"] != before["gpu-0"]  # a new worker process
    assert now["gpu-1"] == before["gpu-1"] and now["cpu"] == before["cpu"]
