"""Hostile input to the observing surfaces: odd heartbeat metrics, odd events, bad
command lines, peers that are no scheduler.

Any worker sends whatever heartbeat metric it likes, and events of any shape can reach
the ``accelsched`` topic (anyone connected may log there, as in distributed: a client,
a task, code run on the scheduler).
None of it may break ``accelsched status``, the events command, the dashboard's history
or the Prometheus registry for everybody else, nor grow the scheduler's memory. The
worker here is a real in-process worker whose own metric function is swapped for a
forger's (a hostile worker process would send the same bytes); the peers that are no
scheduler are real TCP servers on threads of the test; nothing else is mocked.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from distributed import Worker
from distributed.utils_test import captured_logger, gen_cluster

import accelsched
from accelsched.cli import _interruptible
from accelsched.demo.chart import report_path
from accelsched.devices import BACKEND_ENV
from accelsched.display import render
from accelsched.protocol import GUARD_METRIC, PLACEMENT_PLUGIN, STATUS_HANDLER
from accelsched.testing import state
from tests import processes
from tests.processes import running
from tests.utils import (
    ACCELSCHED,
    GPU_WORKER,
    SIMULATE,
    cli,
    cli_process,
    gpus,
    status_snapshot,
    until,
    wait_for,
)

pytestmark = pytest.mark.usefixtures("fake_gpus_2")

#: Heartbeat metrics a hostile or broken worker could send.
FORGED_METRICS: list[Any] = [
    "x",
    [1],
    {"devices": "xx"},
    {"devices": [1, 2]},
    {"devices": [{"index": 0}]},  # figures missing
    {"devices": [{"index": [0]}]},  # unhashable index
    {
        "devices": [
            {
                "index": 0,
                "leases": "many",
                "withdrawn": [],
                "leak_estimate": "x",
                "leak_threshold": {},
            }
        ]
    },
    {
        "devices": [
            {
                "index": 0,
                "leases": -1,
                "withdrawn": False,
                "leak_estimate": 1.5,
                "leak_threshold": 2**64 - 1,
            }
        ]
    },
]


async def status(c: Any) -> Any:
    return await getattr(c.scheduler, STATUS_HANDLER)()


def as_sent(value: Any) -> Any:
    """``value`` as the scheduler holds it: msgpack turns lists into tuples."""
    if isinstance(value, (list, tuple)):
        return tuple(as_sent(v) for v in value)
    if isinstance(value, dict):
        return {k: as_sent(v) for k, v in value.items()}
    return value


async def heartbeat_until(a: Worker, s: Any, arrived: Any) -> None:
    """Heartbeat until the scheduler holds a metric ``arrived(metric)`` accepts (a
    heartbeat already on its way when the metric changed is skipped, not repeated)."""

    async def beat() -> None:
        while not arrived(s.workers[a.address].metrics.get(GUARD_METRIC)):
            await a.heartbeat()
            await asyncio.sleep(0.01)

    await asyncio.wait_for(beat(), 15)


@gen_cluster(client=True, nthreads=GPU_WORKER, Worker=Worker, timeout=60)
async def test_a_forged_heartbeat_metric_breaks_no_status(c, s, a):
    await accelsched.register(c)

    def figures_arrived() -> bool:
        """the worker's verified GPU with figures from a heartbeat"""
        snap = status_snapshot(s)
        return any(d["leases"] is not None for w in snap["workers"] for d in w["devices"])

    await wait_for(figures_arrived)
    honest = a.metrics[GUARD_METRIC]
    observer = s.plugins[PLACEMENT_PLUGIN].status_history
    for forged in FORGED_METRICS:
        a.metrics[GUARD_METRIC] = lambda worker, forged=forged: forged
        await heartbeat_until(a, s, lambda metric, forged=forged: metric == as_sent(forged))
        snap = await status(c)
        (device,) = snap["workers"][0]["devices"]  # still the verified GPU
        assert device["leases"] is None, forged  # the figures are unknown, not odd
        assert device["leak_estimate"] is None and device["withdrawn"] is False
        assert device["figures"] == "unreadable", forged  # not "waiting": it did speak
        assert "waiting" not in render(snap)  # what `accelsched status` prints
        observer.sample()  # the dashboard's history
    a.metrics[GUARD_METRIC] = honest
    await heartbeat_until(a, s, lambda metric: metric == as_sent(honest(a)))
    (device,) = (await status(c))["workers"][0]["devices"]
    assert device["leases"] == 0 and device["leak_threshold"] > 0


@gen_cluster(client=True, nthreads=GPU_WORKER, Worker=Worker, timeout=60)
async def test_odd_events_break_nothing_and_grow_nothing(c, s, a):
    """Events of every odd shape reaching the log anyway (code run on the scheduler, a
    task on a worker calling ``log_event``) break no hook and grow no memory."""
    from prometheus_client import REGISTRY

    await accelsched.register(c)
    await wait_for(lambda: gpus(s, a.address) == 1)
    observer = s.plugins[PLACEMENT_PLUGIN].status_history
    forged: list[dict[str, Any]] = [
        {"action": "restart"},  # no figures at all
        {"action": "restart", "worker": ["x"]},  # unhashable worker
        {"action": "leak", "worker": {"a": 1}, "nbytes": "x", "device": "x"},
        {"action": "leak", "worker": a.address, "nbytes": -5},
        {"action": "gpu-rejected", "owner": 5, "uuids": 3},
        {"action": "fallback", "count": -3, "waited": "x", "reason": "forged-reason"},
        {"action": "fallback", "waited": float("nan")},
        {"action": ["restart"]},  # unhashable action
    ]
    forged += [{"action": "restart", "worker": f"tcp://10.0.0.{i}:1"} for i in range(50)]
    forged += [{"action": f"bogus-{i}"} for i in range(50)]
    with captured_logger("distributed.broker") as log:
        for msg in forged:
            s.log_event("accelsched", msg)  # as run_on_scheduler could
        await wait_for(lambda: len(s.get_events("accelsched")) >= len(forged))
    assert "Plugin failed" not in log.getvalue()
    # counted in the totals; per worker only for the one worker that exists
    assert set(observer.counts) <= {a.name, str(a.name)}
    assert observer.counts[str(a.name)]["leaks"] == 1
    assert (await status(c))["restarts"] == 52
    # the registry: no label for an action or reason accelsched does not know
    labels = {
        (sample.labels.get("action"), sample.labels.get("reason"))
        for metric in REGISTRY.collect()
        if metric.name.startswith("accelsched")
        for sample in metric.samples
    }
    assert not {lab for lab in labels if lab[0] and lab[0].startswith("bogus")}
    assert (None, "forged-reason") not in labels
    # and the events command prints every one of ours, a line each, no traceback
    code, out, err = await cli("events", s.address, "--action", "restart", "--action", "leak")
    assert code == 0, err
    assert "Traceback" not in err
    assert len(out.strip().splitlines()) == 54
    code, out, err = await cli("events", s.address, "--action", "gpu-rejected")
    assert code == 0 and "owner" in out, err
    # as JSON: strict, a NaN or infinity as its name (before: NaN and Infinity, no JSON)
    s.log_event("accelsched", {"action": "fallback", "waited": float("inf"), "n": [float("nan")]})
    code, out, err = await cli("events", s.address, "--action", "fallback", "--json")
    assert code == 0, err

    def strict(constant: str) -> None:
        raise ValueError(f"no JSON: {constant}")

    said = [json.loads(line, parse_constant=strict) for line in out.splitlines()]
    assert {"waited": "nan"} in [{"waited": e.get("waited")} for e in said]
    assert said[-1]["waited"] == "inf" and said[-1]["n"] == ["nan"]


@pytest.mark.parametrize(
    "args, named",
    [
        (["status", "tcp://127.0.0.1:1", "--timeout", "bogus"], "--timeout='bogus'"),
        (["status", "tcp://127.0.0.1:1", "--timeout=-1s"], "--timeout='-1s'"),
        (["status", "tcp://127.0.0.1:1", "--timeout", "0"], "--timeout='0'"),
        (["events", "tcp://127.0.0.1:1", "--timeout", "1e400s"], "--timeout='1e400s'"),
        (["status", "foo://127.0.0.1:1", "--timeout", "1s"], "'foo://127.0.0.1:1'"),
        (["events", "no-port", "--timeout", "1s"], "'no-port'"),
        (["status", "", "--timeout", "1s"], "''"),
        (["status", "tcp://127.0.0.1:1", "--timeout", "None"], "--timeout='None'"),
    ],
)
def test_a_bad_command_line_is_a_usage_error_naming_the_value(args, named):
    code, out, err = asyncio.run(cli(*args))
    assert code == 2 and out == ""
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert named in last
    # what it offers is what it takes (None, no limit, is not)
    assert "--timeout" not in named or last.endswith(
        "expected a duration > 0, like '10s' or '500ms'"
    )


@pytest.mark.parametrize("value, kind", [("0", "int"), ("8786", "int"), ("True", "bool")])
def test_a_scheduler_address_dask_config_reads_as_no_string_is_refused(monkeypatch, value, kind):
    """dask config reads ``DASK_SCHEDULER_ADDRESS=8786`` as the int 8786: exit 2 naming
    it (before: no word, and the number was the exit code: ``0`` said success, ``8786``
    exited 82)."""
    monkeypatch.setenv("DASK_SCHEDULER_ADDRESS", value)
    code, out, err = asyncio.run(cli("status", "--timeout", "1s"))
    assert (code, out) == (2, "")
    (line,) = err.strip().splitlines()
    assert (
        line == f"accelsched status: invalid scheduler address {value}: expected str, got {kind!r}"
    )


def test_a_transport_that_cannot_connect_here_is_a_bad_address():
    """``ucx://`` without UCX's package: distributed keeps an abstract connector, which
    failed as ``TypeError: Can't instantiate abstract class`` (exit 1, "cannot reach")."""
    from distributed.comm.registry import get_backend

    try:
        get_backend("ucx").get_connector()
    except Exception:
        pass
    else:
        pytest.skip("UCX can connect from here")
    code, out, err = asyncio.run(cli("status", "ucx://127.0.0.1:1", "--timeout", "1s"))
    (line,) = err.strip().splitlines()
    assert (code, out) == (2, "") and line.startswith(
        "accelsched status: invalid scheduler address 'ucx://127.0.0.1:1': distributed's "
        "'ucx' transport cannot connect from here"
    )


def test_a_timeout_is_read_as_accelsched_reads_durations():
    """``.5s`` is half a second (dask alone reads it as 1.5 s)."""
    code, _, err = asyncio.run(cli("status", "tcp://127.0.0.1:1", "--timeout", ".5s"))
    assert code == 1 and "no answer within 0.5s" in err, err


@pytest.mark.parametrize("every", ["0.2", "5"], ids=["in-a-snapshot", "in-a-long-pause"])
def test_watch_ends_when_the_scheduler_goes(every: str):
    """The scheduler closes under ``--watch``: exit 1 with one line, no traceback, no
    hang, whether it goes during a snapshot or during a pause longer than the client
    tries to reconnect (it then has closed itself)."""

    async def run() -> tuple[int, str]:
        from distributed import Client, Scheduler

        s = await Scheduler(port=0, dashboard_address=":0")
        async with Client(s.address, asynchronous=True) as c:
            await accelsched.register(c)
        proc = await cli_process("status", s.address, "--json", "--watch", every, "--timeout", "1s")
        assert proc.stdout is not None and proc.stderr is not None
        assert (await asyncio.wait_for(proc.stdout.readline(), 60)).startswith(b"{")
        await s.close()
        code = await asyncio.wait_for(proc.wait(), 60)
        return code, (await proc.stderr.read()).decode()

    code, err = asyncio.run(run())
    (line,) = err.strip().splitlines()
    assert code == 1 and line.startswith("accelsched status: lost the scheduler at"), err


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_a_report_path_that_cannot_be_written_is_refused_before_the_demo(tmp_path):
    """``/proc`` is a folder nobody can create a file in, root included: refused at once
    (exit 2, one line), not with a traceback after the whole demo has run."""
    code, out, err = asyncio.run(cli("demo", "--report", "/proc/accelsched-demo.html"))
    assert code == 2 and out == ""
    (line,) = err.strip().splitlines()
    assert "'/proc/accelsched-demo.html'" in line and "cannot write there" in line
    # a writable place is checked without leaving a file behind
    assert report_path(tmp_path / "r.html") == (tmp_path / "r.html").resolve()
    assert not (tmp_path / "r.html").exists()


@pytest.mark.parametrize("entry", ["²", "٣", "０", "1²"])
def test_visible_devices_with_digits_cuda_does_not_read_name_no_device(entry, caplog):
    """``str.isdigit`` holds for "²" (and ``int`` then raises) and for "٣" or "０" (and
    ``int`` reads them as 3 and 0); CUDA reads ASCII digits only, so such an entry names
    no device: the list ends there, without blaming NVML."""
    from accelsched.devices import NVMLMonitor, Visible, resolve_devices

    assert resolve_devices([entry], ["GPU-a", "GPU-b", "GPU-c", "GPU-d"]) == []
    assert resolve_devices(["1", entry], ["GPU-a", "GPU-b"]) == [Visible(1)]
    monitor = NVMLMonitor(env={"CUDA_VISIBLE_DEVICES": f"1,{entry}"})
    assert [d.nvml_index for d in monitor.devices()] == [1]
    assert "NVML failed" not in caplog.text


class Peer:
    """A TCP server that is no scheduler: it accepts and then says ``reply`` (nothing:
    silent, as a dashboard port or a stopped scheduler), on a thread of this process."""

    def __init__(self, reply: bytes = b"") -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"tcp://127.0.0.1:{self.sock.getsockname()[1]}"
        self.reply = reply
        self.accepted = threading.Event()
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = self.sock.accept()
                self.conns.append(conn)
                self.accepted.set()
                if self.reply:
                    conn.sendall(self.reply)

    def close(self) -> None:
        self.sock.close()
        for conn in self.conns:
            conn.close()


@pytest.mark.parametrize(
    "reply",
    [b"", b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n" * 3, b"\xff" * 64],
    ids=["silent", "http", "garbage"],
)
@pytest.mark.parametrize("command", ["status", "events"])
def test_a_peer_that_is_no_scheduler_is_unreachable_in_time(command: str, reply: bytes):
    """distributed bounds the connection, not the handshake: a silent peer held the
    commands forever; a peer speaking another protocol gave a traceback (or exit 2, as
    if the address were bad)."""
    peer = Peer(reply)
    try:
        started = time.monotonic()
        code, out, err = asyncio.run(cli(command, peer.address, "--timeout", "1", timeout=60))
        took = time.monotonic() - started
    finally:
        peer.close()
    assert peer.accepted.is_set()
    assert (code, out) == (1, "")
    (line,) = err.strip().splitlines()
    assert line.startswith(f"accelsched {command}: cannot reach a scheduler at {peer.address}")
    assert took < 30  # bounded by --timeout (1 s) and Python's start, not by the test's 60


def test_an_address_is_checked_and_shown_on_one_line():
    code, _, err = asyncio.run(cli("status", "tcp://127.0.0.1:99999", "--timeout", "1"))
    assert code == 2
    assert err.strip() == (
        "accelsched status: invalid scheduler address 'tcp://127.0.0.1:99999': "
        "port 99999 is out of range"
    )
    code, _, err = asyncio.run(cli("events", "tls://127.0.0.1:1", "--timeout", "1"))
    (line,) = err.strip().splitlines()  # TLS without its configuration: no traceback
    assert code == 1 and "cannot reach a scheduler at tls://127.0.0.1:1: TypeError" in line
    code, _, err = asyncio.run(cli("status", "tcp://127.0.0.1:1\n\x1b[2J", "--timeout", "0.5"))
    (line,) = err.strip().splitlines()  # a newline or escape in it is shown escaped
    assert code == 2 and "address 'tcp://127.0.0.1:1\\n\\x1b[2J'" in line
    code, _, err = asyncio.run(cli("status", "tcp://a\nb:1", "--timeout", "0.5"))
    (line,) = err.strip().splitlines()
    assert code == 1 and "cannot reach a scheduler at 'tcp://a\\nb:1'" in line


def test_ctrl_c_stops_work_that_swallowed_the_cancellation():
    """Until Python 3.12 ``asyncio.wait_for`` swallows a cancellation that meets its
    result: a client connected as Ctrl-C came went on to wait a minute on the handshake
    (one of the commands' CI runs under Python 3.10). The work here swallows one."""
    cleaned: list[bool] = []

    async def body() -> int:
        with contextlib.suppress(asyncio.CancelledError):  # as wait_for may
            await asyncio.sleep(60)
        await asyncio.sleep(60)
        return 0

    async def cleanup() -> None:
        cleaned.append(True)

    async def main() -> int:
        asyncio.get_running_loop().call_later(0.2, os.kill, os.getpid(), signal.SIGINT)
        return await _interruptible(body, cleanup)

    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        asyncio.run(main())
    assert cleaned == [True]
    assert time.monotonic() - started < 30  # not the minute the work would take
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # given back


@pytest.mark.parametrize("watch", [[], ["--watch", "1"]], ids=["once", "watch"])
def test_ctrl_c_before_an_answer_is_exit_130_without_traceback(watch: list[str]):
    async def run() -> tuple[int | None, bytes]:
        peer = Peer()
        try:
            proc = await cli_process("status", peer.address, "--timeout", "60", *watch)
            assert await asyncio.get_running_loop().run_in_executor(None, peer.accepted.wait, 60)
            proc.send_signal(signal.SIGINT)
            _, err = await asyncio.wait_for(proc.communicate(), 30)
            return proc.returncode, err
        finally:
            peer.close()

    code, err = asyncio.run(run())
    assert code == 130 and err == b"", err  # no traceback, no warning of a half-made client


@pytest.mark.parametrize(
    "args",
    [["status", "--json", "--watch", "0.1"], ["events", "--follow", "--json"]],
    ids=["status-watch", "events-follow"],
)
@gen_cluster(client=True, nthreads=GPU_WORKER, Worker=Worker, timeout=60)
async def test_a_reader_that_leaves_ends_watch_quietly(c, s, a, args):
    """``accelsched status --json --watch | head -1``: the pipe closes under it. So does
    ``events --follow | head -1`` on a cluster where nothing more happens (before: it
    waited for ever, as nothing more was written)."""
    await accelsched.register(c)
    await wait_for(lambda: gpus(s, a.address) == 1)  # its gpu-verified event is logged
    command, *rest = args
    proc = await cli_process(command, s.address, *rest)
    assert proc.stdout is not None and proc.stderr is not None
    assert json.loads(await asyncio.wait_for(proc.stdout.readline(), 60))
    proc.stdout.feed_eof()
    transport = proc._transport  # type: ignore[attr-defined]
    transport.get_pipe_transport(1).close()  # the reader is gone
    code = await asyncio.wait_for(proc.wait(), 30)
    err = await proc.stderr.read()
    assert code == 0 and err == b"", err


@pytest.mark.parametrize("output", ["closed", "full"])
@gen_cluster(client=True, nthreads=GPU_WORKER, Worker=Worker, timeout=60)
async def test_output_that_cannot_be_written_is_one_line_and_exit_74(c, s, a, output):
    """stdout closed (``accelsched status >&-``) or a full disk (``> /dev/full``): one
    line and exit 74, sysexits' EX_IOERR (before: a traceback and exit 1, which says the
    scheduler could not be reached)."""
    if output == "full" and not Path("/dev/full").exists():
        pytest.skip("no /dev/full here")
    await accelsched.register(c)
    with open(os.devnull if output == "closed" else "/dev/full", "w") as sink:
        proc = await asyncio.create_subprocess_exec(
            *[sys.executable, "-m", "accelsched.cli", "status", s.address],
            stdout=sink,
            stderr=subprocess.PIPE,
            # (a descriptor closed in the child: Python starts with sys.stdout None)
            preexec_fn=(lambda: os.close(1)) if output == "closed" else None,
        )
        _, err = await asyncio.wait_for(proc.communicate(), 60)
    reason = "stdout is closed" if output == "closed" else "No space left on device"
    assert (proc.returncode, err.decode()) == (
        74,
        f"accelsched status: cannot write its output: {reason}\n",
    )


@pytest.mark.parametrize("asked", ["version", "--version", "dask --version"])
@pytest.mark.parametrize("output", ["closed", "full"])
def test_the_version_that_cannot_be_written_is_one_line_and_exit_74(output, asked):
    """As status and events (before: a traceback and exit 1 on a full disk; exit 0,
    nothing said, with stdout closed; ``--version`` as click wrote it too)."""
    if output == "full" and not Path("/dev/full").exists():
        pytest.skip("no /dev/full here")
    with open(os.devnull if output == "closed" else "/dev/full", "w") as sink:
        # (as dask's own subcommand: the program is `dask accelsched`)
        argv = (
            [sys.executable, "-m", "dask", "accelsched", "--version"]
            if asked.startswith("dask")
            else [sys.executable, "-m", "accelsched.cli", asked]
        )
        done = subprocess.run(
            argv,
            stdout=sink,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=(lambda: os.close(1)) if output == "closed" else None,
            timeout=60,
        )
    reason = "stdout is closed" if output == "closed" else "No space left on device"
    command = " version" if asked == "version" else ""
    assert (done.returncode, done.stderr) == (
        74,
        f"accelsched{command}: cannot write its output: {reason}\n",
    )


#: Worker names that act on a terminal printed raw: clear the screen; forge a row.
HOSTILE_NAMES = ["\x1b[2J", "evil\nrow"]


def raw_controls(text: str) -> list[str]:
    """The characters of ``text`` that would act rather than show: C0 and C1 controls,
    bidi overrides, line separators (all but the lines' own newlines)."""
    return [ch for ch in text if ch != "\n" and not ch.isprintable()]


@gen_cluster(client=True, nthreads=[], timeout=90)
async def test_hostile_names_are_shown_escaped_never_acted_on(c, s):
    """Anyone can name a worker, and a worker reports its own devices: nothing of it may
    act on the terminal of whoever runs ``accelsched status`` or ``events``, nor forge a
    line. The device name and UUID are set on the scheduler's grant, where a hostile
    guard's inventory would put them; the event through ``log_event`` on the scheduler,
    as any code run there could."""
    async with (
        Worker(s.address, name=HOSTILE_NAMES[0], nthreads=1, resources={"GPU": 1}) as a,
        Worker(s.address, name=HOSTILE_NAMES[1], nthreads=1, resources={"GPU": 1}) as b,
    ):
        await _hostile_names(c, s, a, b)


async def _hostile_names(c: Any, s: Any, a: Worker, b: Worker) -> None:
    await accelsched.register(c)
    grants = s.plugins[PLACEMENT_PLUGIN].grants

    def judged() -> bool:
        """one worker verified, the other corrected (both see the same two GPUs; the
        first to report owns the one it claims)"""
        done = {m["action"] for _, m in s.get_events("accelsched")}
        return {"gpu-verified", "gpu-corrected"} <= done

    await wait_for(judged, timeout=30)
    owner, other = (a, b) if grants.of(a.address).devices else (b, a)
    (device,) = grants.of(owner.address).devices  # the grant's own record
    device["name"] = "GPU\x1b]0;owned\x07\u202eevil"
    device["uuid"] = "GPU-1\r\nforged  0  NVIDIA"
    s.log_event(
        "accelsched",
        {
            "action": "quarantine",
            "worker": other.address,
            "reason": "bad\n12:00:00 [restart] x\x9b2J",
        },
    )

    code, out, err = await cli("status", s.address)
    assert code == 0, err
    assert raw_controls(out) == [], out
    snap = await status(c)
    rows = sum(max(1, len(w["devices"])) for w in snap["workers"])
    assert len(out.splitlines()) == 3 + rows  # summary, options, heading, a line a row
    assert "'\\x1b[2J'" in out and "'evil\\nrow'" in out
    assert "\\u202e" in out and "\\r\\n" in out

    code, out, err = await cli("status", s.address, "--json")
    assert code == 0, err
    assert out.isascii() and raw_controls(out) == [] and len(out.splitlines()) == 1
    assert {w["name"] for w in json.loads(out)["workers"]} == set(HOSTILE_NAMES)

    code, out, err = await cli("events", s.address)
    assert code == 0, err
    assert raw_controls(out) == [], out
    ours = [m for _, m in s.get_events("accelsched") if m["action"] in accelsched.events.ACTIONS]
    assert len(out.splitlines()) == len(ours)  # one line an event, however named
    assert "'evil\\nrow: " in out and "\\x9b" in out


def test_hostile_worker_names_on_a_command_line_cluster(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same where users meet it: ``dask worker --name`` given an escape sequence and
    a newline, each on a simulated GPU, joining ``dask scheduler --preload accelsched``;
    ``accelsched status`` and ``accelsched events`` run as the commands they are."""
    # Each worker brings its own simulated GPU (``accelsched simulate``), which refuses to
    # run inside this module's fake GPUs: the processes start without them.
    for key in (state.ENV_DIR, state.ENV_STANDIN, BACKEND_ENV):
        monkeypatch.delenv(key, raising=False)
    sched = processes.scheduler(tmp_path, "--preload", "accelsched")
    with running(sched):
        address = processes.scheduler_address(tmp_path / "scheduler.json", sched)
        workers = [
            processes.worker(tmp_path, name, address, before=SIMULATE) for name in HOSTILE_NAMES
        ]
        with running(*workers):

            def command(*args: str) -> str:
                done = subprocess.run(
                    [ACCELSCHED, *args, address], capture_output=True, text=True, timeout=60
                )
                assert done.returncode == 0, done.stderr
                return done.stdout

            def verified() -> bool:
                """both hostile-named workers' GPUs verified"""
                snap = json.loads(command("status", "--json"))
                return sorted(len(w["devices"]) for w in snap["workers"]) == [1, 1]

            until(verified, timeout=60)
            out = command("status")
            assert raw_controls(out) == [], out
            assert len(out.splitlines()) == 3 + 2  # summary, options, heading, a row each
            assert "'\\x1b[2J'" in out and "'evil\\nrow'" in out

            out = command("events", "--action", "gpu-verified")
            assert raw_controls(out) == [], out
            lines = out.splitlines()
            assert len(lines) == 2 and all(re.match(r"\d\d:\d\d:\d\d ", ln) for ln in lines)
            assert "'\\x1b[2J: verified" in out and "'evil\\nrow: verified" in out
