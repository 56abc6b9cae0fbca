"""dask-cuda for real: ``LocalCUDACluster`` and ``dask cuda worker`` on two fake GPUs.

dask-cuda starts one worker per GPU and gives each every GPU in rotated order
(``CUDA_VISIBLE_DEVICES="0,1"`` / ``"1,0"``): a worker owns its first visible device only.
Runs where dask-cuda is installed (``pip install ".[test,dask-cuda]"``; ``.ci/run`` builds
that environment), skipped elsewhere.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import dask
import dask.sizeof
import pytest
from distributed import Client, get_worker

import accelsched
from accelsched.testing import FakeGPUs, fake_gpus
from tests import processes
from tests.processes import running
from tests.utils import FAST, events, gpu_counts, leaky, until

dask_cuda = pytest.importorskip("dask_cuda")


@pytest.fixture(scope="module")
def gpus() -> Iterator[FakeGPUs]:
    with fake_gpus(count=2, memory="16GiB") as g:
        if g.standin:
            pytest.skip("dask-cuda reads NVML itself: needs the fake library (a C compiler)")
        yield g


def granted(client: Client) -> dict[str, str]:
    """Worker address -> the UUID its latest ``gpu-verified`` event granted."""
    out: dict[str, str] = {}
    for e in events(client, "gpu-verified"):
        (device,) = e["devices"]
        out[e["worker"]] = device["uuid"]
    return out


def first_visible(client: Client) -> dict[str, str]:
    """Worker address -> its first CUDA_VISIBLE_DEVICES entry (as dask-cuda set it)."""
    visible = client.run(lambda: os.environ["CUDA_VISIBLE_DEVICES"])
    return {addr: cvd.split(",")[0] for addr, cvd in visible.items()}


def owns_first_visible(client: Client, gpus: FakeGPUs) -> None:
    """Every worker verified for exactly its first visible device, one GPU each."""
    first = first_visible(client)
    assert sorted(first.values()) == ["0", "1"]  # one worker per GPU
    uuids = granted(client)
    assert {a: uuids.get(a) for a in first} == {a: gpus.uuids[int(i)] for a, i in first.items()}
    assert gpu_counts(client) == dict.fromkeys(first, 1)


def bound() -> tuple[str, int | None, str]:
    return get_worker().address, accelsched.current_device(), os.environ["CUDA_VISIBLE_DEVICES"]


# --- LocalCUDACluster, plugins registered by a client -----------------------------------------


@pytest.fixture(scope="module")
def cuda_cluster(gpus: FakeGPUs) -> Iterator[Client]:
    with (
        dask_cuda.LocalCUDACluster(dashboard_address=":0", protocol="tcp") as cluster,
        Client(cluster) as client,
    ):
        accelsched.register(client, **FAST)
        until(lambda: len(granted(client)) == 2, timeout=60)
        yield client


def test_local_cuda_cluster_one_worker_per_gpu_each_owns_its_first(
    cuda_cluster: Client, gpus: FakeGPUs
) -> None:
    owns_first_visible(cuda_cluster, gpus)
    assert not events(cuda_cluster, "gpu-rejected")  # rotated: nobody claims another's


def test_local_cuda_cluster_gpu_tasks_bound_to_the_owned_device(cuda_cluster: Client) -> None:
    with dask.annotate(resources={"GPU": 1}):
        futures = cuda_cluster.map(lambda i: bound(), range(8), pure=False)
    results = cuda_cluster.gather(futures)
    verified = set(granted(cuda_cluster))
    for addr, device, cvd in results:
        assert addr in verified
        assert device == 0  # CUDA index 0: the first visible device, the one it owns
        assert cvd.split(",")[0] == first_visible(cuda_cluster)[addr]


def test_leak_restarts_the_worker_and_the_new_one_is_verified(
    cuda_cluster: Client, gpus: FakeGPUs
) -> None:
    victim = sorted(granted(cuda_cluster))[0]
    device = first_visible(cuda_cluster)[victim]
    with dask.annotate(resources={"GPU": 1}):
        assert cuda_cluster.submit(leaky, 1, workers=[victim]).result() == 1
    until(lambda: events(cuda_cluster, "restart"), timeout=60)
    (leak,) = events(cuda_cluster, "leak")
    assert leak["worker"] == victim and "leaky" in leak["prefixes"]
    cuda_cluster.wait_for_workers(2, timeout=60)

    def replaced() -> bool:
        """the restarted worker's guard verified its device again"""
        workers = set(gpu_counts(cuda_cluster))
        return victim not in workers and len(set(granted(cuda_cluster)) & workers) == 2

    until(replaced, timeout=60)
    owns_first_visible(cuda_cluster, gpus)
    new = next(a for a, i in first_visible(cuda_cluster).items() if i == device)
    assert granted(cuda_cluster)[new] == gpus.uuids[int(device)]


# --- device results in dask-cuda's DeviceHostFile -----------------------------------------------


class Frame:
    """Stands in for a cudf frame: device memory behind a type accelsched has no rule for,
    which dask-cuda takes for a device object (it has ``__cuda_array_interface__``), so a
    ``DeviceHostFile`` keeps it in its device dict, and spills it to the host past its
    ``device_memory_limit`` (its ``sizeof`` is its bytes)."""

    def __init__(self, nbytes: int) -> None:
        from accelsched.testing import device_alloc

        self.payload = device_alloc(nbytes)

    @property
    def __cuda_array_interface__(self) -> dict:  # (what dask-cuda asks; nobody reads it)
        return {"shape": (self.payload.nbytes,), "typestr": "|u1", "data": (0, False), "version": 3}


dask.sizeof.sizeof.register(Frame)(lambda frame: frame.payload.nbytes)


@accelsched.gpu
def make_frame(i: int) -> Frame:
    return Frame(64 * 2**20)


class Model:
    """Stands in for a fitted GPU model: device memory behind a type dask-cuda does not
    take for a device object, so a ``DeviceHostFile`` keeps it in its host dict."""

    def __init__(self, nbytes: int) -> None:
        from accelsched.testing import device_alloc

        self.weights = device_alloc(nbytes)


@accelsched.gpu
def fit(i: int) -> Model:
    return Model(32 * 2**20)


def _guard_state(dask_worker) -> tuple[str, int, int, int]:  # type: ignore[no-untyped-def]
    """The worker's data type, what results hold on device 0 (live, and in memory), and
    the frames in the DeviceHostFile's device dict."""
    ledger = dask_worker.plugins["accelsched-guard"].ledger
    on_device = sum(isinstance(v, Frame) for v in dask_worker.data.device.values())
    return type(dask_worker.data).__name__, ledger.live(0), ledger.resident(0), on_device


@pytest.mark.parametrize("device_memory_limit", ["default", "200MiB"])
def test_device_results_in_a_device_host_file_are_held_where_they_are(
    gpus: FakeGPUs, device_memory_limit: str
) -> None:
    """Twelve 64 MiB device results of one step on a dask-cuda worker (its data a
    ``DeviceHostFile``): after the step's first runs, sampling leaves most runs unmeasured,
    and their results are held by what the worker stores in its device dict; past a
    200 MiB ``device_memory_limit`` most are spilled to the host, which gives their device
    memory back. Checks run, then all released: no leak (before: the guard read the
    ``DeviceHostFile``'s ``fast``, its host dict alone, found no device object there, held
    the unmeasured runs' results at nothing, and declared them a leak)."""
    with (
        dask_cuda.LocalCUDACluster(
            CUDA_VISIBLE_DEVICES="0",
            device_memory_limit=device_memory_limit,
            dashboard_address=":0",
            protocol="tcp",
        ) as cluster,
        Client(cluster) as client,
    ):
        accelsched.register(client, **FAST)
        until(lambda: len(granted(client)) == 1, timeout=60)
        frames = [client.submit(make_frame, i, pure=False) for i in range(12)]
        client.gather(frames)
        model = client.submit(fit, 0, pure=False)  # measured: its prefix's first run
        client.gather(model)
        ((data, live, resident, on_device),) = client.run(_guard_state).values()
        assert data == "DeviceHostFile" and live == (12 * 64 + 32) * 2**20
        # what is on the device: the model (in the host dict, never spilled) and the
        # frames still in the device dict (before: the model counted as spilled too)
        assert resident == (on_device * 64 + 32) * 2**20
        assert on_device < 12 if device_memory_limit == "200MiB" else on_device == 12
        time.sleep(1)  # checks
        assert not events(client, "leak")
        del frames, model
        until(lambda: list(client.run(_guard_state).values())[0][1] == 0, timeout=30)
        time.sleep(1)
        assert not events(client, "leak") and not events(client, "quarantine")


# --- dask cuda worker --preload accelsched, against a preloaded dask scheduler ------------------


@pytest.fixture(scope="module")
def cli_cluster(gpus: FakeGPUs, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Client]:
    tmp = tmp_path_factory.mktemp("dask_cuda_cli")
    sched = processes.scheduler(tmp, "--preload", "accelsched")
    with running(sched):
        address = processes.scheduler_address(tmp / "scheduler.json", sched)
        worker = processes.Process(
            [processes.DASK, "cuda", "worker", address, "--preload", "accelsched"]
            + ["--no-dashboard", "--local-directory", str(tmp / "w")],
            tmp / "cuda-worker.log",
        )
        with running(worker), Client(address, timeout=30) as client:
            client.wait_for_workers(2, timeout=60)
            until(lambda: len(granted(client)) == 2, timeout=60)
            client.worker_log = worker  # type: ignore[attr-defined]
            yield client


def test_dask_cuda_worker_cli_preloaded(cli_cluster: Client, gpus: FakeGPUs) -> None:
    owns_first_visible(cli_cluster, gpus)
    with dask.annotate(resources={"GPU": 1}):
        results = cli_cluster.gather(cli_cluster.map(lambda i: bound(), range(4), pure=False))
    assert {device for _, device, _ in results} == {0}
    modules = cli_cluster.run(
        lambda dask_worker: sorted({type(p).__module__ for p in dask_worker.plugins.values()})
    )
    for found in modules.values():  # dask-cuda's plugins beside the guard
        assert {"accelsched.worker.guard_plugin", "dask_cuda.plugins"} <= set(found)
    log = cli_cluster.worker_log.output()  # type: ignore[attr-defined]
    assert "Failed to start preload" not in log  # dask_cuda.initialize and accelsched both ran
    said = [line for line in log.splitlines() if "accelsched:" in line]
    assert said and not [line for line in said if " - INFO - " not in line], said  # no error,
    # no warning: the options in effect, as INFO lines


def test_dask_cuda_is_the_supported_release() -> None:
    """The extra's dask-cuda pins a dask/distributed inside accelsched's range."""
    from importlib.metadata import version

    assert int(version("dask-cuda").split(".")[0]) >= 26
    oldest, newest = accelsched.internals.TESTED_DISTRIBUTED
    installed = tuple(int(p) for p in version("distributed").split(".")[:3])
    assert tuple(int(p) for p in oldest.split(".")) <= installed
    assert installed[:2] <= tuple(int(p) for p in newest.split(".")[:2])


def test_preload_ignores_dask_cudas_flag_and_warns_about_its_own(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """dask-cuda hands its ``--create-cuda-context`` to every preload, and every preload's
    arguments to its own (which then fails): accelsched drops the flag, says so for the
    rest."""
    import dask_cuda.initialize  # noqa: F401  (as dask cuda worker has it imported)

    from accelsched.deploy.install import dask_setup

    with caplog.at_level("WARNING", logger="accelsched.deploy.install"):
        alone = dask_setup.make_context("dask_setup", ["--create-cuda-context"]).params
    assert "invalid" not in alone and not caplog.records
    with caplog.at_level("WARNING", logger="accelsched.deploy.install"):
        argv = ["--leak-threshold", "1GiB", "--create-cuda-context"]
        both = dask_setup.make_context("dask_setup", argv).params
    assert both["leak_threshold"] == "1GiB"
    (warning,) = caplog.records
    assert "dask_cuda.initialize" in warning.getMessage()
    assert "--leak-threshold 1GiB" in warning.getMessage()
