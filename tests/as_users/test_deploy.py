"""``--preload accelsched``: a GPU cluster started from the command line, no client code.

Real ``dask scheduler`` and ``dask worker`` processes (the venv's ``dask`` command) on two
fake GPUs; a client only looks. The processes of each cluster start once per module.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import click
import dask
import pytest
from distributed import Client, Scheduler, Status, Worker, get_worker
from distributed.utils_test import gen_test

import accelsched
from accelsched import internals
from accelsched.config import Threshold
from accelsched.protocol import PLACEMENT_PLUGIN
from accelsched.testing import FakeGPUs, fake_gpus
from tests import processes
from tests.processes import Process, running
from tests.utils import device_result, events, gpu_counts, leaky, until

GPU_WORKERS = 3  # "gpu0" (device 0), "gpu1-0" and "gpu1-1" (both see device 1)


@pytest.fixture(scope="module")
def gpus() -> Iterator[FakeGPUs]:
    with fake_gpus(count=2, memory="16GiB") as g:
        yield g


def names(client: Client) -> dict[str, str]:
    return {a: w["name"] for a, w in internals.workers_listed(client).items()}


# --- a scheduler preloaded with accelsched ---------------------------------------------


@pytest.fixture(scope="module")
def preloaded(gpus: FakeGPUs, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Client]:
    """``dask scheduler --preload accelsched`` (an option as preload argument, one from
    a config variable) and three kinds of workers:

    - ``gpu0``: device 0, declares ``GPU=1``, no preload: the scheduler hands it a guard;
      its own config sets two guard options, one of which the scheduler gave explicitly;
    - ``gpu1``: two nanny workers that both see device 1, declare nothing, and run
      ``--preload accelsched`` themselves, with an option of their own;
    - ``cpu``: sees no device, declares ``GPU=1``.
    """
    tmp = tmp_path_factory.mktemp("preloaded")
    sched = processes.scheduler(
        tmp,
        "--preload",
        "accelsched",
        "--leak-threshold",
        "256MiB",
        env={
            "DASK_ACCELSCHED__PLACEMENT__MAX_RESTARTS": "7",
            "DASK_ACCELSCHED__PLACEMENT__FALLBACK_TIMOUT": "5s",  # a typo: said, ignored
        },
    )
    with running(sched) as procs:
        address = processes.scheduler_address(tmp / "scheduler.json", sched)
        workers = [
            processes.worker(
                tmp,
                "gpu0",
                address,
                "--resources",
                "GPU=1",
                env={
                    "CUDA_VISIBLE_DEVICES": "0",
                    "DASK_ACCELSCHED__GUARD__FREE_POOLS_EVERY": "5",  # its own: used
                    "DASK_ACCELSCHED__GUARD__LEAK_THRESHOLD": "128MiB",  # explicit wins
                    "DASK_ACCELSCHED__GUARD__FREE_POOL_EVERY": "2",  # a typo: said, ignored
                },
            ),
            processes.worker(
                tmp,
                "gpu1",
                address,
                "--nworkers",
                "2",
                "--preload",
                "accelsched",
                "--check-interval",
                "300ms",  # the worker's own option: used (the scheduler's is from config)
                env={"CUDA_VISIBLE_DEVICES": "1"},
            ),
            processes.worker(
                tmp, "cpu", address, "--resources", "GPU=1", env={"CUDA_VISIBLE_DEVICES": ""}
            ),
        ]
        with running(*workers), Client(address, timeout=30) as client:
            client.wait_for_workers(4, timeout=60)
            until(lambda: len(events(client, "gpu-verified")) == 2, timeout=60)
            client.procs = [*procs, *workers]  # type: ignore[attr-defined]
            yield client


def test_scheduler_preload_installs_both_plugins_with_its_options(preloaded: Client) -> None:
    placement = preloaded.run_on_scheduler(
        lambda dask_scheduler: dask_scheduler.plugins["accelsched-placement"].options
    )
    assert placement["max_restarts"] == 7  # DASK_ACCELSCHED__PLACEMENT__MAX_RESTARTS
    assert placement["fallback_timeout"] is None  # the default
    by_address = {a: w["name"] for a, w in internals.workers_listed(preloaded).items()}
    guards = {
        by_address[a]: o
        for a, o in preloaded.run(
            lambda dask_worker: dask_worker.plugins["accelsched-guard"].options
        ).items()
    }
    assert sorted(guards) == ["cpu", "gpu0", "gpu1-0", "gpu1-1"]
    for name, options in guards.items():
        # the scheduler's explicit preload argument wins over gpu0's own 128MiB
        assert options["leak_threshold"] == Threshold(nbytes=256 * 2**20)
        # each worker's own settings win over the scheduler's config defaults
        assert options["check_interval"] == (0.3 if name.startswith("gpu1") else 1.0), name
        assert options["free_pools_every"] == (5 if name == "gpu0" else 1), name
    logs = {p.log.stem: p.output() for p in preloaded.procs}  # type: ignore[attr-defined]
    assert (
        "accelsched: leak_threshold=134217728 bytes from this worker's dask config "
        "accelsched.guard.leak-threshold is not used: the GuardPlugin was given "
        "leak_threshold=268435456 bytes explicitly" in logs["gpu0"]
    )
    assert (
        "free_pools_every=5 (this worker's dask config accelsched.guard.free-pools-every)"
        in logs["gpu0"]
    )
    # each of its two workers says so once (and shows it among the options in effect)
    assert (
        logs["gpu1"].count(
            "WARNING - accelsched: this worker's own settings apply to its guard: "
            "check_interval=0.3 (this worker's --preload accelsched)"
        )
        == 2
    )
    # a misspelled key in a process's own config is named where that process logs, once
    assert (
        logs["scheduler"].count(
            "WARNING - accelsched: dask config accelsched.placement.fallback_timout (did you "
            "mean accelsched.placement.fallback-timeout?) is not an accelsched option: ignored"
        )
        == 1
    )
    assert "did you mean accelsched.guard.free-pools-every?" in logs["gpu0"]
    assert "is not an accelsched option" not in logs["gpu1"] + logs["cpu"]
    # and the nannies fork new worker processes from a warm server (fast_restart)
    names = preloaded.run_on_scheduler(lambda dask_scheduler: list(dask_scheduler.nanny_plugins))
    assert names == ["accelsched-fast-restart"]
    methods = preloaded.run(
        lambda: __import__("dask").config.get("distributed.worker.multiprocessing-method"),
        nanny=True,
    )
    assert set(methods.values()) == {"forkserver"}


def test_every_worker_verified_and_the_gpu_less_one_corrected(preloaded: Client) -> None:
    by_address = names(preloaded)
    verified = {by_address[e["worker"]] for e in events(preloaded, "gpu-verified")}
    assert "gpu0" in verified and len(verified & {"gpu1-0", "gpu1-1"}) == 1
    counts = gpu_counts(preloaded, by_name=True)
    assert counts["gpu0"] == 1
    assert sorted([counts["gpu1-0"], counts["gpu1-1"]]) == [0, 1]  # one device, one owner
    assert counts["cpu"] == 0  # declared GPU=1, has none
    (corrected,) = [
        e for e in events(preloaded, "gpu-corrected") if by_address[e["worker"]] == "cpu"
    ]
    assert corrected["reason"] == "no-devices" and corrected["declared"] == 1
    (rejected,) = events(preloaded, "gpu-rejected")
    assert by_address[rejected["worker"]] in ("gpu1-0", "gpu1-1")


def where_and_device(i: int) -> tuple[str, int | None]:
    return get_worker().name, accelsched.current_device()


def test_gpu_tasks_are_placed_on_verified_devices_and_bound(preloaded: Client) -> None:
    counts = gpu_counts(preloaded, by_name=True)
    owner1 = next(n for n in ("gpu1-0", "gpu1-1") if counts[n] == 1)
    with dask.annotate(resources={"GPU": 1}):
        futures = preloaded.map(where_and_device, range(12), pure=False)
    results = preloaded.gather(futures)
    assert {name for name, _ in results} <= {"gpu0", owner1}
    assert {device for _, device in results} == {0}  # each worker's own: its CUDA device 0


def test_a_later_register_keeps_the_plugins_and_refuses_other_options(preloaded: Client) -> None:
    """The preload's plugins are kept: register() with nothing new changes nothing, and
    an option that differs from what they run with is an error naming both values."""
    before = preloaded.run_on_scheduler(
        lambda dask_scheduler: id(dask_scheduler.plugins["accelsched-placement"])
    )
    verified = len(events(preloaded, "gpu-verified"))
    placement, guard = accelsched.register(preloaded)  # the running ones, not this client's
    assert (placement.options["max_restarts"], guard.options["leak_threshold"]) == (
        7,
        Threshold(nbytes=256 * 2**20),
    )
    accelsched.register(preloaded, max_restarts=7, leak_threshold="256MiB")  # as they run
    with pytest.raises(
        ValueError,
        match=r"register\(\) was given fallback_timeout='1s' "
        r"\(the running PlacementPlugin has None\); leak_threshold='1GiB' "
        r"\(the running GuardPlugin has 268435456 bytes\)",
    ):
        accelsched.register(preloaded, fallback_timeout="1s", leak_threshold="1GiB")
    after = preloaded.run_on_scheduler(
        lambda dask_scheduler: (
            id(dask_scheduler.plugins["accelsched-placement"]),
            dask_scheduler.plugins["accelsched-placement"].options["fallback_timeout"],
        )
    )
    assert after == (before, None)
    assert len(events(preloaded, "gpu-verified")) == verified


# --- workers preloaded, the scheduler not -----------------------------------------------


@pytest.fixture(scope="module")
def workers_only(gpus: FakeGPUs, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Client]:
    """A plain scheduler; ``dask worker --preload accelsched`` with a preload argument
    and a config variable, seeing no device but declaring ``GPU=1``."""
    tmp = tmp_path_factory.mktemp("workers_only")
    sched = processes.scheduler(tmp)
    with running(sched):
        address = processes.scheduler_address(tmp / "scheduler.json", sched)
        cpu = processes.worker(
            tmp,
            "cpu",
            address,
            "--resources",
            "GPU=1",
            "--preload",
            "accelsched",
            "--leak-threshold",
            "1GiB",
            env={"CUDA_VISIBLE_DEVICES": "", "DASK_ACCELSCHED__GUARD__FREE_POOLS_EVERY": "3"},
        )
        with running(cpu), Client(address, timeout=30) as client:
            client.wait_for_workers(1, timeout=60)
            client.cpu = cpu  # type: ignore[attr-defined]
            yield client


def _dataframe_imported() -> bool:
    import sys

    return "dask.dataframe" in sys.modules


def test_guards_under_a_plain_scheduler_stop_sending_what_it_has_no_handler_for(
    gpus: FakeGPUs, tmp_path: Path
) -> None:
    """``dask worker --preload accelsched`` under a plain ``dask scheduler``: results that
    move the device room, then a leak. The guard asks the scheduler's metadata first,
    which says no PlacementPlugin runs there: it sends no report, offer or restart
    request, and the scheduler logs nothing (before: the report, answered None, left
    distributed's ``No handler`` warning and a traceback in the scheduler's log; earlier
    still, every offer and a restart request at every check did: 18 in 10 s). A
    PlacementPlugin registered later on its own asks this guard (known by its heartbeat
    metric) to report, and verifies its GPU (before: never)."""
    sched = processes.scheduler(tmp_path)
    with running(sched):
        address = processes.scheduler_address(tmp_path / "scheduler.json", sched)
        worker = processes.worker(
            tmp_path,
            "gpu",
            address,
            "--resources",
            "GPU=1",
            "--preload",
            "accelsched",
            "--leak-threshold",
            "256MiB",
            "--check-interval",
            "100ms",
            env={"CUDA_VISIBLE_DEVICES": "0"},
        )
        with running(worker), Client(address, timeout=30) as client:
            client.wait_for_workers(1, timeout=60)
            until(lambda: "no PlacementPlugin on the scheduler" in worker.output(), timeout=60)
            with dask.annotate(resources={"GPU": 1}):
                results = client.map(device_result, range(40), pure=False)  # 2.5 GiB held
                assert client.gather(results)[-1].value == 39
                assert client.submit(leaky, 1, pure=False).result() == 1
            until(lambda: events(client, "leak"), timeout=60)
            time.sleep(1)  # ten more checks of the leak: each asked a restart before
            log = sched.output()
            assert "No handler" not in log, log
            assert worker.output().count("no PlacementPlugin on the scheduler") == 1
            assert not events(client, "gpu-verified")
            client.register_plugin(accelsched.PlacementPlugin())
            until(lambda: len(events(client, "gpu-verified")) == 1, timeout=60)


def test_worker_preload_installs_the_guard_with_its_options(workers_only: Client) -> None:
    until(lambda: gpu_counts(workers_only, by_name=True)["cpu"] == 0)  # declared 1, owns none
    (options,) = workers_only.run(
        lambda dask_worker: dask_worker.plugins["accelsched-guard"].options
    ).values()
    assert options["leak_threshold"] == Threshold(nbytes=2**30)
    assert options["free_pools_every"] == 3
    assert options["preimport"] == ("dask.dataframe",)  # imported before the worker starts
    assert list(workers_only.run(_dataframe_imported).values()) == [True]
    # no PlacementPlugin: the worker's log says so
    log: Process = workers_only.cpu  # type: ignore[attr-defined]
    until(lambda: "no PlacementPlugin on the scheduler" in log.output())
    assert "Placement is not enforced: start the scheduler with --preload accelsched" in (
        log.output()
    )
    plugins = workers_only.run_on_scheduler(lambda dask_scheduler: sorted(dask_scheduler.plugins))
    assert "accelsched-placement" not in plugins


def test_a_workers_own_config_reaches_its_guard(gpus: FakeGPUs, tmp_path: Path) -> None:
    """A scheduler preloaded with the defaults (a 10% leak threshold: 1.6 GiB here); one
    worker's own ``DASK_ACCELSCHED__GUARD__LEAK_THRESHOLD=256MiB``, as a helm chart's
    worker ``env:`` sets it: its guard uses it, says so, and sees a 512 MiB leak."""
    sched = processes.scheduler(tmp_path, "--preload", "accelsched")
    with running(sched):
        address = processes.scheduler_address(tmp_path / "scheduler.json", sched)
        env = {
            "CUDA_VISIBLE_DEVICES": "0",
            "DASK_ACCELSCHED__GUARD__LEAK_THRESHOLD": "256MiB",
            "DASK_ACCELSCHED__GUARD__CHECK_INTERVAL": "100ms",
        }
        worker = processes.worker(tmp_path, "gpu", address, env=env)
        with running(worker), Client(address, timeout=30) as client:
            client.wait_for_workers(1, timeout=60)
            until(lambda: len(events(client, "gpu-verified")) == 1, timeout=60)
            with dask.annotate(resources={"GPU": 1}):
                assert client.submit(leaky, 1, pure=False).result() == 1
            until(lambda: events(client, "leak"), timeout=60)
            (leak, *_) = events(client, "leak")
            assert leak["threshold"] == 256 * 2**20 and "leaky" in leak["prefixes"]
            assert (
                "leak_threshold=268435456 bytes (this worker's dask config "
                "accelsched.guard.leak-threshold)" in worker.output()
            )


def test_precedence_on_one_worker_in_numbers() -> None:
    """Explicit > the worker's preload > the worker's own config > as handed."""
    from accelsched.config import on_this_worker

    handed = accelsched.GuardPlugin(leak_confirmations=3).options  # explicit: 3
    config = {
        "accelsched.guard.leak-confirmations": 5,  # overruled by the explicit 3
        "accelsched.guard.free-pools-every": 4,  # the worker's own: wins
        "accelsched.guard.check-interval": "2s",  # the worker's preload says 300ms: wins
    }
    with dask.config.set(config):
        options, sources, overruled = on_this_worker(
            handed, {"leak_confirmations"}, {"check_interval": 0.3}
        )
    assert options == {**handed, "free_pools_every": 4, "check_interval": 0.3}
    assert overruled == {
        "leak_confirmations": (5, "this worker's dask config accelsched.guard.leak-confirmations")
    }
    assert sources == {
        "free_pools_every": "this worker's dask config accelsched.guard.free-pools-every",
        "check_interval": "this worker's --preload accelsched",
    }
    # nothing set on the worker: exactly as handed, nothing to say
    assert on_this_worker(handed, {"leak_confirmations"}, {}) == (handed, {}, {})
    # how nannies start workers is not a worker's to set: said, not used (before: logged
    # as applied, while its nanny went on forking)
    with dask.config.set({"accelsched.guard.fast-restart": False}):
        assert on_this_worker(handed, (), {}) == (
            handed,
            {},
            {"fast_restart": (False, "this worker's dask config accelsched.guard.fast-restart")},
        )
    assert on_this_worker(handed, (), {"fast_restart": False})[2] == {
        "fast_restart": (False, "this worker's --preload accelsched")
    }
    with (
        dask.config.set({"accelsched.guard.leak-threshold": "lots"}),
        pytest.raises(ValueError, match="invalid leak_threshold='lots'"),
    ):
        on_this_worker(handed, (), {})


# --- bad options stop the server, with one clear line -------------------------------------


def test_bad_preload_argument_stops_the_scheduler(gpus: FakeGPUs, tmp_path: Path) -> None:
    proc = processes.scheduler(tmp_path, "--preload", "accelsched", "--fallback-timeout", "soon")
    assert proc.wait(60) == 2
    out = proc.output()
    assert "Invalid value for '--fallback-timeout'" in out and "'soon'" in out
    assert "Traceback" not in out and "Usage:" not in out  # one line: click's usage is noise


def test_bad_config_value_stops_the_worker(gpus: FakeGPUs, tmp_path: Path) -> None:
    env = {"DASK_ACCELSCHED__GUARD__LEAK_THRESHOLD": "lots"}
    proc = processes.worker(tmp_path, "w", "tcp://127.0.0.1:1", "--preload", "accelsched", env=env)
    assert proc.wait(60) == 2
    out = proc.output()
    assert "dask config accelsched.guard.leak-threshold" in out and "'lots'" in out
    assert "Traceback" not in out and "Usage:" not in out


def test_bad_preload_argv_from_config_stops_the_started_scheduler(
    gpus: FakeGPUs, tmp_path: Path
) -> None:
    """Preload and its arguments from dask config (as dask-gateway or a helm chart may
    set them) are parsed only as the scheduler starts: it stops instead of running
    without accelsched."""
    env = {
        "DASK_DISTRIBUTED__SCHEDULER__PRELOAD": '["accelsched"]',
        "DASK_DISTRIBUTED__SCHEDULER__PRELOAD_ARGV": '["--share-gpus", "maybe"]',
    }
    proc = processes.scheduler(tmp_path, env=env)
    assert proc.wait(60) == 1  # a supervisor (systemd, Kubernetes, Slurm) sees a failure
    out = proc.output()
    errors = [line for line in out.splitlines() if "accelsched:" in line or "ERROR" in line]
    assert len(errors) == 1, out
    # one line of accelsched's ERROR log, in distributed's format
    assert " - accelsched.deploy.install - ERROR - " in errors[0], errors
    said = errors[0].split(" - ERROR - ", 1)[1]
    assert said.startswith("accelsched: Invalid value for '--share-gpus'")
    assert "'maybe'" in said and said.endswith("stopping this scheduler")


def test_placement_options_given_to_a_worker_stop_it(workers_only: Client, tmp_path: Path) -> None:
    """On the command line: refused as ``dask worker`` parses it, before anything starts."""
    address = workers_only.scheduler.address
    proc = processes.worker(
        tmp_path, "w", address, "--preload", "accelsched", "--fallback-timeout", "5s"
    )
    assert proc.wait(60) == 2
    out = proc.output()
    assert (
        "Error: --fallback-timeout '5s' applies to the scheduler (placement), not to a worker"
        in out
    )
    assert "Traceback" not in out and "Usage:" not in out


@pytest.mark.parametrize("given", [["--leak-threshold=2GiB"], ["--leak-threshold", "2GiB"]])
def test_a_preload_option_taken_for_the_address_stops_the_worker(
    tmp_path: Path, given: list[str]
) -> None:
    """``dask worker --scheduler-file ... --preload accelsched --leak-threshold=2GiB``:
    the command's optional address argument takes the option. Refused by name, exit 2
    (before: dropped without a word, the worker ran at 10 %; or, with a space, click's
    ``Got unexpected extra argument (2GiB)``)."""
    proc = processes.Process(
        [processes.DASK, "worker", "--scheduler-file", str(tmp_path / "s.json")]
        + ["--no-dashboard", "--preload", "accelsched", *given],
        tmp_path / "w.log",
    )
    assert proc.wait(60) == 2
    out = proc.output()
    assert f"Error: {given[0]!r} was taken for the scheduler's address" in out, out
    assert "DASK_ACCELSCHED__GUARD__" in out and "Traceback" not in out


def test_python_m_commands_stop_as_dask_commands_do(workers_only: Client, tmp_path: Path) -> None:
    """``python -m distributed.cli.dask_worker`` (the command dask-jobqueue's job scripts
    run) and ``python -m distributed.cli.dask_scheduler``: the same exits as ``dask worker``
    and ``dask scheduler`` (before: 0 every time, and the worker given a scheduler's
    option started, registered and set its guard up before it stopped)."""
    address = workers_only.scheduler.address
    module = [sys.executable, "-m", "distributed.cli.dask_worker", address, "--no-dashboard"]
    refused = processes.Process(
        [*module, "--preload", "accelsched", "--fallback-timeout", "5s"], tmp_path / "w1.log", None
    )
    assert refused.wait(60) == 2
    out = refused.output()
    assert "--fallback-timeout '5s' applies to the scheduler (placement), not to a worker" in out
    assert "Traceback" not in out and "Usage:" not in out and "Start worker" not in out
    argv = '["--leak-threshold", "lots"]'
    env = {"DASK_DISTRIBUTED__WORKER__PRELOAD": '["accelsched"]'}
    from_config = processes.Process(
        [*module, "--name", "w2"],
        tmp_path / "w2.log",
        {**env, "DASK_DISTRIBUTED__WORKER__PRELOAD_ARGV": argv},
    )
    assert from_config.wait(60) == 1, from_config.output()
    assert "'lots'" in from_config.output()
    scheduler = processes.Process(
        [sys.executable, "-m", "distributed.cli.dask_scheduler", "--port", "0", "--no-dashboard"],
        tmp_path / "scheduler.log",
        {
            "DASK_DISTRIBUTED__SCHEDULER__PRELOAD": '["accelsched"]',
            "DASK_DISTRIBUTED__SCHEDULER__PRELOAD_ARGV": '["--share-gpus", "maybe"]',
        },
    )
    assert scheduler.wait(60) == 1, scheduler.output()
    assert "stopping this scheduler" in scheduler.output()


def test_placement_options_from_config_stop_the_started_worker(
    workers_only: Client, tmp_path: Path
) -> None:
    """From dask config the arguments are parsed in the worker's own process, under its
    nanny: the worker stops, its nanny with it, and ``dask worker`` exits with 1."""
    env = {
        "DASK_DISTRIBUTED__WORKER__PRELOAD": '["accelsched"]',
        "DASK_DISTRIBUTED__WORKER__PRELOAD_ARGV": '["--max-restarts", "2", "--share-gpus", "true"]',
    }
    proc = processes.worker(tmp_path, "w", workers_only.scheduler.address, env=env)
    assert proc.wait(60) == 1
    out = proc.output()
    (line,) = [
        line.split(" - ERROR - ", 1)[-1] for line in out.splitlines() if "accelsched:" in line
    ]
    assert line == (
        "accelsched: --share-gpus 'true', --max-restarts '2' apply to the scheduler "
        "(placement), not to a worker: give them to `dask scheduler --preload accelsched`; "
        "stopping this worker"
    )


# --- beside another preload that takes arguments (dask-gateway's) ---------------------------

GATEWAY_LIKE = """
import click


@click.command()
@click.option("--dg-api-address", default=":0")
def dask_setup(scheduler, dg_api_address):
    scheduler.gateway_like = dg_api_address
"""


def test_configured_preload_beside_a_click_preload(gpus: FakeGPUs, tmp_path: Path) -> None:
    """dask-gateway starts ``dask scheduler --preload dask_gateway.scheduler_preload
    --dg-...``: distributed refuses a second preload that takes arguments, and hands the
    ``--dg-...`` ones to every preload. ``accelsched.configured`` takes none."""
    (tmp_path / "gateway_like.py").write_text(GATEWAY_LIKE)
    env = {
        "PYTHONPATH": str(tmp_path),  # beside the tests' own path
        "DASK_ACCELSCHED__PLACEMENT__FALLBACK_TIMEOUT": "45s",
    }
    args = ["--preload", "accelsched.configured", "--preload", "gateway_like"]
    sched = processes.scheduler(tmp_path, *args, "--dg-api-address", ":8788", env=env)
    with running(sched):
        address = processes.scheduler_address(tmp_path / "scheduler.json", sched)
        with Client(address, timeout=30) as client:
            placement, gateway = client.run_on_scheduler(
                lambda dask_scheduler: (
                    dask_scheduler.plugins["accelsched-placement"].options["fallback_timeout"],
                    dask_scheduler.gateway_like,
                )
            )
    assert (placement, gateway) == (45.0, ":8788")


# --- the preload's arguments, parsed as distributed parses them ------------------------------


def test_none_on_the_command_line_wins_over_config() -> None:
    from accelsched.deploy.install import dask_setup, split_options

    with dask.config.set({"accelsched.placement.fallback-timeout": "30s"}):
        given = dask_setup.make_context("dask_setup", ["--fallback-timeout", "none"]).params
        placement, guard = split_options(given)
        assert placement == {"fallback_timeout": None} and guard == {}
        assert accelsched.PlacementPlugin(**placement).options["fallback_timeout"] is None
        plain = dask_setup.make_context("dask_setup", []).params
        assert split_options(plain) == ({}, {})  # nothing given: config decides
    # at a server's start a bad argument is handed on (to stop the server), not raised
    bad = dask_setup.make_context("dask_setup", ["--share-gpus", "none"]).params
    assert bad == {
        "invalid": "Invalid value for '--share-gpus': invalid share_gpus=None: "
        "expected True or False"
    }
    # on the command line distributed parses it itself: click's usage error
    with pytest.raises(click.BadParameter, match="invalid share_gpus=None"):
        dask_setup.parse_args(click.Context(dask_setup), ["--share-gpus", "none"])


def test_oom_exceptions_repeat() -> None:
    from accelsched.deploy.install import dask_setup, split_options

    argv = ["--oom-exceptions", "a.OOM", "--oom-exceptions", "b.OOM", "--leak-threshold", "0.2"]
    _, guard = split_options(dask_setup.make_context("dask_setup", argv).params)
    options = accelsched.GuardPlugin(**guard).options
    assert options["oom_exceptions"] == ("a.OOM", "b.OOM")
    # a bare name is a builtin's, as the names are matched (``module.QualName``)
    one = accelsched.GuardPlugin(oom_exceptions=["MemoryError", "cupy.X"]).options
    assert one["oom_exceptions"] == ("builtins.MemoryError", "cupy.X")
    assert options["leak_threshold"] == Threshold(fraction=0.2)


def test_a_list_option_given_as_none_is_the_empty_list() -> None:
    """``--preimport none`` imports nothing, whatever dask config says (before: a module
    named ``none``, skipped with a log line); ``none`` beside names is refused."""
    from accelsched.deploy.install import dask_setup, split_options

    with dask.config.set({"accelsched.guard.oom-exceptions": ["a.OOM"]}):
        argv = ["--preimport", "none", "--oom-exceptions", "None"]
        _, guard = split_options(dask_setup.make_context("dask_setup", argv).params)
        options = accelsched.GuardPlugin(**guard).options
    assert (options["preimport"], options["oom_exceptions"]) == ((), ())
    argv = ["--preimport", "none", "--preimport", "a.b"]
    assert dask_setup.make_context("dask_setup", argv).params == {
        "invalid": "Invalid value for '--preimport': invalid preimport=['none', 'a.b']: "
        "'none' stands alone (no names)"
    }


# --- dask config without accelsched's keys ----------------------------------------------------


@gen_test()
async def test_absent_config_keys_are_the_built_in_defaults() -> None:
    """A harness that restores a config snapshot taken before accelsched was imported (as
    distributed's test clusters do) leaves no ``accelsched`` keys: the preload and the
    plugins take the built-in defaults, and the cluster runs plain tasks as before."""
    saved = dask.config.config.pop("accelsched")
    try:
        assert dask.config.get("accelsched.placement.fallback-interval", None) is None
        with dask.config.set({"accelsched.guard.leak-confirmations": 3}):  # present: used
            guard = accelsched.GuardPlugin().options
        assert guard["leak_confirmations"] == 3 and guard["check_interval"] == 1.0
        async with (
            Scheduler(dashboard_address=":0", preload=["accelsched"]) as s,
            Worker(s.address, preload=["accelsched"]) as w,
            Client(s.address, asynchronous=True) as c,
        ):
            assert await c.submit(lambda x: x + 1, 1) == 2
            assert s.status == Status.running and w.status == Status.running
            placement = s.plugins[PLACEMENT_PLUGIN]
            assert placement.options["fallback_interval"] == 0.25
            assert placement.options["fallback_timeout"] is None
    finally:
        dask.config.config["accelsched"] = saved


@gen_test()
async def test_a_second_preload_on_one_scheduler_says_its_options_are_not_used(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``--preload accelsched --preload accelsched.configured`` with other options in
    dask config: the first installs, the second says its options are not used (before:
    both logged "installed" with their own options, and the second's were not running)."""
    with (
        dask.config.set({"accelsched.placement.fallback-timeout": "5s"}),
        caplog.at_level("INFO", logger="accelsched"),
    ):
        async with Scheduler(
            dashboard_address=":0",
            preload=["accelsched", "accelsched.configured"],
            preload_argv=[["--fallback-timeout", "30s"], []],
        ) as s:
            assert s.plugins[PLACEMENT_PLUGIN].options["fallback_timeout"] == 30
    said = [r.getMessage() for r in caplog.records if r.name.startswith("accelsched")]
    assert sum("PlacementPlugin installed" in m for m in said) == 1, said
    (kept,) = [m for m in said if "installed already" in m]
    assert "'fallback_timeout': 5.0" in kept and "'fallback_timeout': 30.0" in kept
