"""The text an operator reads reads as dask's own: every event in words (sizes as
``dask.utils.format_bytes`` writes them, no raw dict, a worker that declared nothing said
so), and accelsched's log lines set up through dask's ``logging`` config, as
distributed's are."""

from __future__ import annotations

import logging
import os
import textwrap

import pytest
from dask.utils import format_bytes

from accelsched import events
from accelsched.config import LOGGER, initialize_logging, unknown_config
from tests.utils import run_python

W = "tcp://10.0.0.5:40123"

#: (event, what its line must say): one or more per action, the odd figures included.
CASES = [
    (
        events.event(
            events.GPU_VERIFIED,
            W,
            granted=1,
            devices=[{"index": 0, "uuid": "GPU-1", "name": "NVIDIA H100", "memory": 80 * 2**30}],
        ),
        f"{W}: verified 1 GPU(s): NVIDIA H100, UUID GPU-1, CUDA index 0",
    ),
    (
        events.event(events.GPU_CORRECTED, W, declared=2, granted=1, reason="fewer-devices"),
        f"{W}: declared GPU=2, granted 1 (fewer-devices)",
    ),
    (
        events.event(events.GPU_CORRECTED, W, declared=None, granted=1, reason="advertised"),
        f"{W}: declared no GPU; advertises the 1 it has (advertise_undeclared)",
    ),
    (
        events.event(
            events.GPU_CORRECTED, W, declared=None, granted=0, reason="invalid-declaration: 'two'"
        ),
        f"{W}: declared no usable GPU count; granted 0 (invalid-declaration: 'two')",
    ),
    (
        events.event(events.GPU_REJECTED, W, uuids=["GPU-1", "GPU-2"], reason="owned", owner="B"),
        f"{W}: refused GPU-1, GPU-2: owned by B",
    ),
    (
        events.event(events.GPU_REJECTED, W, uuids=("GPU-1",), reason="owned", owner=["B", "C"]),
        f"{W}: refused GPU-1: owned by B, C",
    ),
    (
        events.event(
            events.UNREQUESTED_GPU_USE,
            W,
            key="rogue",
            device=0,
            nbytes=64 * 2**20,
            context_created=True,
            failed=True,
        ),
        f"{W}: task 'rogue' used device 0 without asking for a GPU (+64.00 MiB; a CUDA "
        "context created; the task made to fail)",
    ),
    (
        events.event(events.FALLBACK, key="x", waited=0.3, reason="timeout", count=1),
        "task 'x': fell back to its CPU form after 0.3s (timeout)",
    ),
    (
        events.event(
            events.FALLBACK, W, key="big", waited=0.0, reason="oom", error="OutOfMemoryError: x"
        ),
        f"task 'big' on {W}: fell back to its CPU form after 0.0s (oom: OutOfMemoryError: x)",
    ),
    (
        events.event(
            events.FALLBACK,
            count=40,
            keys=[f"f-{i}" for i in range(10)],
            reason="timeout",
            reasons={"timeout": 30, "chain": 10},
            waited=1.0,
            waited_max=2.5,
        ),
        "40 tasks fell back (30 timeout, 10 chain; waited 1.0s median, 2.5s max; "
        "e.g. 'f-0', 'f-1', 'f-2')",
    ),
    (
        events.event(
            events.LEAK,
            W,
            device=0,
            nbytes=1536 * 2**20,
            threshold=256 * 2**20,
            checks=2,
            prefixes=("leaky", "load"),
            attributed={"leaky": 1536 * 2**20},
            unexplained=0,
            reclaimed=0,
        ),
        f"{W}: device 0 leaks 1.50 GiB (threshold 256.00 MiB, prefixes leaky, load)",
    ),
    (
        events.event(
            events.LEAK_RECLAIMED,
            W,
            device=0,
            nbytes=2**29,
            reclaimed=2**29,
            remaining=0,
            threshold=2**28,
            prefixes=[],
            seconds=0.03,
        ),
        f"{W}: device 0 got 512.00 MiB back by collecting garbage and freeing pools (0 B "
        "left, threshold 256.00 MiB, prefixes none): no restart",
    ),
    (
        events.event(events.RESTART, W, reason="leak", moved=4, assigned=0, seconds=1.2),
        f"{W}: retired (4 keys moved to peers) and restarted in 1.2s (leak)",
    ),
    (
        events.event(events.RESTART_DEFERRED, W, reason="no-peer"),
        f"{W}: restart deferred (no-peer)",
    ),
    (
        events.event(events.QUARANTINE, W, reason="restart-budget"),
        f"{W}: GPUs taken out of placement until it restarts or leaves (restart-budget)",
    ),
    (
        events.event(events.GPU_UNHEALTHY, W, device=1, uuid="GPU-2", error="NVMLError(15)"),
        f"{W}: device 1 (GPU-2) stopped answering NVML: withdrawn (NVMLError(15))",
    ),
    (
        events.event(events.GPU_RECOVERED, W, device=1, uuid="GPU-2"),
        f"{W}: device 1 (GPU-2) answers NVML again: offered again",
    ),
    (
        events.event(events.REQUEST_REFUSED, W, handler="accelsched_restart", reason="stale"),
        f"{W}: accelsched_restart request refused (stale)",
    ),
    (
        events.event(events.UNMET_REQUIREMENT, requirement="memory>=100GiB", key="k"),
        "no verified device meets memory>=100GiB (task 'k' waits)",
    ),
    (
        events.event(
            events.UNMET_REQUIREMENT,
            requirement="memory>=16GiB",
            key="k",
            declarable=int(15.2 * 2**30),
        ),
        "no verified device meets memory>=16GiB (task 'k' waits; the most a task may "
        "declare on one here: 15.20 GiB)",
    ),
    (
        events.event(
            events.OVER_DECLARED, W, key="g", device=0, declared=2**30, measured=4 * 2**30
        ),
        f"{W}: task 'g' declared 1.00 GiB, added 4.00 GiB on device 0",
    ),
    (
        events.event(events.GPU_WAITING, reason="no-verified-gpu", waiting=2, keys=["a", ("b", 0)]),
        "2 GPU task(s) wait unplaced: no worker has a verified GPU (e.g. 'a', ('b', 0))",
    ),
    (
        events.event(
            events.SCALE_UP,
            pool="gpu",
            workers=["gpu-0", "gpu-1"],
            reason="gpu-demand",
            target=2,
            classes=["1x any"],
        ),
        "pool 'gpu': starting gpu-0, gpu-1 (gpu-demand: 1x any; target 2)",
    ),
    (
        events.event(
            events.SCALE_UP,
            pool="cpu",
            workers=["cpu-0"],
            reason="cpu-demand",
            target=1,
            classes=[],
        ),
        "pool 'cpu': starting cpu-0 (cpu-demand; target 1)",
    ),
    (
        events.event(events.SCALE_DOWN, pool="gpu", workers=["gpu-1"], reason="idle", target=0),
        "pool 'gpu': retiring gpu-1 (idle; target 0)",
    ),
    (
        events.event(
            events.FALLBACK,
            key="y",
            waited=60.0,
            reason="timeout",
            count=1,
            pools_at_maximum=["gpu"],
        ),
        "task 'y': fell back to its CPU form after 60.0s (timeout; pools at maximum: gpu)",
    ),
]


def test_every_action_has_a_line_and_a_case() -> None:
    assert set(events._LINES) == events.ACTIONS
    assert {msg["action"] for msg, _ in CASES} == events.ACTIONS


@pytest.mark.parametrize(
    "msg, line", CASES, ids=[f"{m['action']}-{i}" for i, (m, _) in enumerate(CASES)]
)
def test_each_event_in_words(msg: dict, line: str) -> None:
    assert events.describe(msg) == line
    assert "{" not in line  # no raw dict


def test_sizes_are_dasks() -> None:
    msg = events.event(events.LEAK, W, device=0, nbytes=10240 * 2**20, threshold=2**30, prefixes=[])
    assert f"leaks {format_bytes(10240 * 2**20)} " in events.describe(msg)  # 10.00 GiB


def test_the_log_line_is_one_line_at_the_events_level() -> None:
    level, line = events.log_line(events.event(events.RESTART_DEFERRED, W, reason="busy"))
    assert (level, line) == (
        logging.WARNING,
        f"accelsched [restart-deferred] {W}: restart deferred (busy)",
    )
    level, line = events.log_line(
        events.event(events.RESTART, W, reason="leak", moved=0, seconds=1)
    )
    assert level == logging.INFO
    # any client may log to the topic: what it carries cannot forge a second line
    forged = events.event(events.UNMET_REQUIREMENT, requirement="x\n2026 - FORGED", key="k")
    assert "\n" not in events.log_line(forged)[1]


# ---- the loggers, through dask's ``logging`` config --------------------------------------


@pytest.mark.parametrize(
    "config",
    [
        {"logging": {"accelsched": "debug"}},  # distributed sets it up with that level
        {"distributed": {"logging": {"accelsched": "warning"}}},
        {"logging": {"version": 1, "loggers": {}}},  # the full form owns every logger
        {"logging-file-config": "logging.ini"},
    ],
)
def test_a_logging_config_that_says_more_is_left_to_distributed(config: dict) -> None:
    assert not initialize_logging(config)


def test_the_default_is_set_once() -> None:
    handlers = logging.getLogger(LOGGER).handlers[:]
    assert initialize_logging({}) and initialize_logging({"logging": {"distributed": "info"}})
    assert logging.getLogger(LOGGER).handlers == handlers  # set at import, not again


#: A process that logs one INFO and one WARNING line under accelsched, its stderr on
#: stdout (the handler takes the stream of its time).
LOGS = textwrap.dedent(
    """
    import sys
    sys.stderr = sys.stdout
    import accelsched, distributed
    import logging
    logger = logging.getLogger("accelsched.scheduler.fallback")
    logger.info("options in effect")
    logger.warning("a warning")
    """
)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DASK_LOGGING")}
    return {**env, **extra}


def test_accelsched_logs_at_info_as_distributed_does() -> None:
    out = run_python(LOGS, env=_env()).splitlines()
    assert len(out) == 2, out  # each line once
    assert out[0].endswith(" - accelsched.scheduler.fallback - INFO - options in effect")
    assert out[1].endswith(" - accelsched.scheduler.fallback - WARNING - a warning")


def test_dask_logging_config_sets_accelsched_level(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``logging: {accelsched: warning}`` in a dask config file, and the environment."""
    (tmp_path / "logs.yaml").write_text("logging:\n  accelsched: warning\n")
    for env in (_env(DASK_CONFIG=str(tmp_path)), _env(DASK_LOGGING__ACCELSCHED="warning")):
        out = run_python(LOGS, env=env).splitlines()
        assert len(out) == 1 and out[0].endswith(" - WARNING - a warning"), out


def test_an_application_that_configured_logging_prints_each_line_once() -> None:
    code = (
        "import logging, sys\n"
        "logging.basicConfig(stream=sys.stdout, format='%(name)s %(message)s')\n" + LOGS
    )
    out = run_python(code, env=_env()).splitlines()
    assert out == [
        "accelsched.scheduler.fallback options in effect",
        "accelsched.scheduler.fallback a warning",
    ]


# ---- accelsched's own config keys: a typo is named, not silently ignored -----------------


@pytest.mark.parametrize(
    ("section", "said"),
    [
        ({"placement": {"fallback-timeout": "5s", "share_gpus": True}, "nvml_backend": "x"}, []),
        (
            {"placement": {"fallback_timout": "5s"}},
            [
                "accelsched.placement.fallback_timout "
                "(did you mean accelsched.placement.fallback-timeout?)"
            ],
        ),
        (
            {"guard": {"leak-treshold": "1GiB", "free-pools-every": 2}, "gaurd": {}},
            [
                "accelsched.guard.leak-treshold (did you mean accelsched.guard.leak-threshold?)",
                "accelsched.gaurd (did you mean accelsched.guard?)",
            ],
        ),
        ({"zzz": 1}, ["accelsched.zzz"]),  # nothing near it: no guess
        ({"guard": None, "placement": {}}, []),  # YAML groups with every key commented out
        (  # a key that is no plain name is shown as its repr: one line, nothing forged
            {"placement\n2026 - accelsched - WARNING - forged": 1, "guard ": {}},
            [
                "accelsched.'placement\\n2026 - accelsched - WARNING - forged'",
                "accelsched.'guard ' (did you mean accelsched.guard?)",
            ],
        ),
        (
            {"adapt": "x" * 500},
            [
                f"accelsched.adapt='{'x' * 76}... (expected keys under it: "
                "accelsched.adapt.interval, accelsched.adapt.wait-count, "
                "accelsched.adapt.target-duration, accelsched.adapt.idle-after, "
                "accelsched.adapt.start-timeout)"
            ],
        ),
        (
            {"adapt": 5},
            [
                "accelsched.adapt=5 (expected keys under it: accelsched.adapt.interval, "
                "accelsched.adapt.wait-count, accelsched.adapt.target-duration, "
                "accelsched.adapt.idle-after, accelsched.adapt.start-timeout)"
            ],
        ),
    ],
)
def test_config_no_option_reads_is_named(section: dict, said: list[str]) -> None:
    assert unknown_config({"accelsched": section, "distributed": {"anything": 1}}) == said


def test_a_misspelled_config_variable_is_logged_once_by_the_process_that_reads_it() -> None:
    """Both plugins built in one process (as ``register()`` and the scheduler's preload
    build them): each setting said once. ``DASK_ACCELSCHED__ADAPT=5`` is one dask
    replaces with the group's defaults as accelsched's go in: read where dask collects
    the environment."""
    code = (
        "import sys; sys.stderr = sys.stdout\n"
        "import accelsched\n"
        "accelsched.PlacementPlugin(); accelsched.GuardPlugin(); accelsched.PlacementPlugin()\n"
    )
    env = _env(DASK_ACCELSCHED__PLACEMENT__FALLBACK_TIMOUT="5s", DASK_ACCELSCHED__ADAPT="5")
    out = run_python(code, env=env).splitlines()
    assert len(out) == 2, out
    fallback, adapt = sorted(out, key=lambda line: "adapt=5" in line)
    assert fallback.endswith(
        " - accelsched.config - WARNING - accelsched: dask config "
        "accelsched.placement.fallback_timout (did you mean "
        "accelsched.placement.fallback-timeout?) is not an accelsched option: ignored"
    )
    assert "dask config accelsched.adapt=5 (expected keys under it: " in adapt
    assert run_python(code, env=_env()) == ""  # the defaults: nothing said


def test_many_unknown_settings_are_counted_past_the_tenth(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A config file with thousands of stray keys: ten lines and a count, not thousands."""
    import dask

    from accelsched import config

    monkeypatch.setattr(config, "_said_unknown", set())
    stray = {f"k{i}": i for i in range(5000)}
    with dask.config.set({"accelsched.guard": stray}), caplog.at_level("WARNING"):
        config.warn_unknown_config()
        config.warn_unknown_config()  # said already: nothing more
    lines = [r.getMessage() for r in caplog.records if r.name == "accelsched.config"]
    assert len(lines) == config.MAX_UNKNOWN_SAID + 1
    assert lines[0] == (
        "accelsched: dask config accelsched.guard.k0 is not an accelsched option: ignored"
    )
    assert lines[-1] == (
        "accelsched: dask config has 4990 more settings under accelsched that no option "
        "reads, ignored (not listed)"
    )
