"""``accelsched simulate``: a command run on simulated GPUs, as a shell runs it.

Every test runs the real ``accelsched`` command in a process of its own; the commands it
runs are the venv's Python and ``dask``, which see the GPUs through the unmodified pynvml.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import termios
from pathlib import Path

import pytest
from distributed import Client

from tests import processes
from tests.processes import running
from tests.utils import ACCELSCHED, until

SEE_GPUS = """
import json, os, sys
import pynvml
pynvml.nvmlInit()
handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
json.dump({
    "names": [pynvml.nvmlDeviceGetName(h) for h in handles],
    "memory": [pynvml.nvmlDeviceGetMemoryInfo(h).total for h in handles],
    "capability": [list(pynvml.nvmlDeviceGetCudaComputeCapability(h)) for h in handles],
    "state": os.environ["ACCELSCHED_FAKE_NVML_DIR"],
}, sys.stdout)
"""

#: Writes each signal it gets to the file argv[1] ("ready" first); SIGTERM and SIGUSR1 end
#: it with exit code 5, SIGINT only counts. It waits in sigwaitinfo, so it takes each
#: signal as soon as it comes: a second one sent soon after is not merged into the first.
SIGNALLED = """
import signal, sys
from pathlib import Path
log = Path(sys.argv[1])
signals = {signal.SIGINT, signal.SIGTERM, signal.SIGUSR1}
signal.pthread_sigmask(signal.SIG_BLOCK, signals)
with log.open("a") as f:
    f.write("ready\\n")
while True:
    sig = signal.sigwaitinfo(signals).si_signo
    with log.open("a") as f:
        f.write(signal.Signals(sig).name + "\\n")
    if sig != signal.SIGINT:
        sys.exit(5)
"""


def simulate(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [ACCELSCHED, "simulate", *args], capture_output=True, text=True, timeout=timeout
    )


def lines(path: Path) -> list[str]:
    return path.read_text().split() if path.exists() else []


def test_the_command_sees_the_gpus_through_pynvml_and_they_are_gone_after() -> None:
    done = simulate(
        "--gpus", "2", "--memory", "16GiB", "--memory", "8GiB", "--name", "NVIDIA H100 80GB HBM3",
        "--capability", "8.0", "--capability", "7.5", "--", sys.executable, "-c", SEE_GPUS,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["names"] == ["NVIDIA H100 80GB HBM3"] * 2
    assert seen["memory"] == [16 * 2**30, 8 * 2**30]
    assert seen["capability"] == [[8, 0], [7, 5]]
    assert not Path(seen["state"]).exists()  # removed with the session


def test_one_memory_for_every_gpu_and_the_default_name() -> None:
    done = simulate("--gpus", "3", "--memory", "4GiB", "--", sys.executable, "-c", SEE_GPUS)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["memory"] == [4 * 2**30] * 3
    assert seen["names"] == ["NVIDIA Simulated GPU"] * 3
    assert seen["capability"] == [[9, 0]] * 3


@pytest.mark.parametrize(
    ("code", "expected"),
    [("sys.exit(7)", 7), ("sys.exit(0)", 0), ("os.kill(os.getpid(), signal.SIGKILL)", 137)],
)
def test_the_exit_code_is_the_commands(code: str, expected: int) -> None:
    program = f"import os, signal, sys; {code}"
    assert simulate("--gpus", "1", "--", sys.executable, "-c", program).returncode == expected


def test_a_command_that_is_not_there() -> None:
    done = simulate("--gpus", "1", "--", "no-such-command-anywhere")
    assert done.returncode == 127
    assert "no-such-command-anywhere: command not found" in done.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--gpus", "0", "--", "true"], "invalid --gpus '0'"),
        (["--gpus", "two", "--", "true"], "invalid --gpus 'two'"),
        (["--gpus", "65", "--", "true"], "invalid --gpus '65'"),
        (["--gpus", "1", "--memory", "lots", "--", "true"], "invalid size 'lots'"),
        (["--gpus", "1", "--memory", "1e30", "--", "true"], "invalid size '1e30'"),
        (["--gpus", "1", "--memory", str(2**64), "--", "true"], f"invalid size '{2**64}'"),
        (["--gpus", "2", "--memory", "16GiB", "--memory", "8GiB", "--context-memory", "9GiB",
          "--", "true"], "--context-memory '9GiB' is more than a device's memory (8589934592"),
        (["--gpus", "2", "--memory", "1GiB", "--memory", "2GiB", "--memory", "3GiB", "--", "true"],
         "--memory must be one value or a sequence of 2"),
        (["--gpus", "1", "--name", "", "--", "true"], "a name must be non-empty"),
        (["--gpus", "1", "--capability", "nine", "--", "true"],
         "--capability must be 'major.minor'"),
        (["--gpus", "1", "--mig", "9g.1gb", "--", "true"], "not a MIG profile: '9g.1gb'"),
        (["--gpus", "1", "--pid-offset", "-1", "--", "true"], "invalid --pid-offset '-1'"),
        (["--gpus", "1", "--"], "no command to run"),
        (["--gpus", "1"], "no command to run"),
        (["--", "true"], "the following arguments are required: --gpus"),
    ],
)  # fmt: skip
def test_bad_options_are_usage_errors_naming_the_value(args: list[str], message: str) -> None:
    done = simulate(*args)
    assert done.returncode == 2, done
    assert message in done.stderr and done.stderr.count("\n") == 2  # usage and one line
    assert done.stdout == ""


def test_a_simulation_inside_a_simulation_is_refused() -> None:
    inner = [ACCELSCHED, "simulate", "--gpus", "1", "--", "true"]
    done = simulate("--gpus", "1", "--", *inner)
    assert done.returncode == 2
    assert "sessions do not nest" in done.stderr


def start_signalled(tmp_path: Path, **popen: object) -> tuple[subprocess.Popen[bytes], Path]:
    """``accelsched simulate`` running :data:`SIGNALLED`, once its handlers are set."""
    log = tmp_path / "signals"
    proc = subprocess.Popen(
        [ACCELSCHED, "simulate", "--gpus", "1", "--", sys.executable, "-c", SIGNALLED, str(log)],
        **popen,  # type: ignore[call-overload]
    )
    until(lambda: "ready" in lines(log) or proc.poll() is not None, timeout=30)
    assert proc.poll() is None, "the command ended before it was ready"
    return proc, log


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_a_signal_sent_to_simulate_reaches_the_command(tmp_path: Path, sig: int) -> None:
    proc, log = start_signalled(tmp_path)
    proc.send_signal(sig)
    assert proc.wait(30) == 5  # the command's handler ended it
    assert lines(log) == ["ready", signal.Signals(sig).name]


def test_sigint_sent_by_a_process_reaches_the_command_once(tmp_path: Path) -> None:
    proc, log = start_signalled(tmp_path)
    proc.send_signal(signal.SIGINT)
    until(lambda: "SIGINT" in lines(log), timeout=30)
    proc.send_signal(signal.SIGUSR1)  # after any second SIGINT simulate would have sent
    assert proc.wait(30) == 5
    assert lines(log) == ["ready", "SIGINT", "SIGUSR1"]


def test_ctrl_c_at_a_terminal_reaches_the_command_once(tmp_path: Path) -> None:
    """The terminal signals the whole foreground group: simulate must not send it again
    (``dask worker`` takes a second SIGINT as "stop at once")."""
    master, slave = os.openpty()

    def controlling_terminal() -> None:  # in the new session: the pty is its terminal
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    try:
        proc, log = start_signalled(
            tmp_path,
            stdin=slave,
            start_new_session=True,
            preexec_fn=controlling_terminal,
        )
        os.write(master, b"\x03")  # Ctrl-C
        until(lambda: "SIGINT" in lines(log), timeout=30)
        # a SIGINT simulate passed on would reach the command before this SIGUSR1
        proc.send_signal(signal.SIGUSR1)
        assert proc.wait(30) == 5
    finally:
        os.close(master)
        os.close(slave)
    assert lines(log) == ["ready", "SIGINT", "SIGUSR1"]


def test_sigterm_closes_a_simulated_dask_worker_cleanly(tmp_path: Path) -> None:
    """What a supervisor does to ``accelsched simulate -- dask worker``: the worker
    leaves the scheduler, the nanny closes, and the command exits 0."""
    sched = processes.scheduler(tmp_path)
    with running(sched):
        address = processes.scheduler_address(tmp_path / "scheduler.json", sched)
        worker = processes.Process(
            [ACCELSCHED, "simulate", "--gpus", "1", "--", processes.DASK, "worker", address]
            + ["--nthreads", "1", "--no-dashboard", "--name", "sim"],
            tmp_path / "sim.log",
        )
        with running(worker), Client(address, timeout=30) as client:
            client.wait_for_workers(1, timeout=60)
            gpus = client.run(_nvml_count)
            assert list(gpus.values()) == [1]  # the worker's process sees the GPU
            worker.popen.send_signal(signal.SIGTERM)
            assert worker.wait(30) == 0, worker.output()
            until(lambda: not client.scheduler_info()["workers"], timeout=30)
            output = worker.output()
            assert output.count("Received signal SIGTERM") == 1, output
            assert "Traceback" not in output, output


def _nvml_count() -> int:
    import pynvml

    pynvml.nvmlInit()
    return int(pynvml.nvmlDeviceGetCount())
