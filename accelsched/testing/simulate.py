"""``accelsched simulate``: any command on simulated GPUs.

``fake_gpus`` shows fake GPUs to processes started inside it; this runs one command there,
so that a shell can start ``dask worker``, ``dask scheduler`` or ``python script.py`` on
simulated GPUs exactly as a test would inside ``fake_gpus``. The command runs as a child,
not by ``exec``: the session's state directory must outlive it and be removed after it.

Signals meant for the command reach it once. The child stays in this process group, so a
terminal's Ctrl-C (or Ctrl-\\, or a hang-up) reaches it straight from the kernel; those
are not sent again, because ``dask worker`` treats a second SIGINT as "stop now" and would
skip its clean close. The same signals sent by a process (``kill``, a supervisor) reach
only this process, and are passed on.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
from collections.abc import Sequence
from contextlib import ExitStack, suppress
from dataclasses import dataclass, field
from typing import Any

from accelsched.testing.checks import MAX_DEVICES, _check_pid_offset, _parse_size

__all__ = ["BadSimulation", "Simulation", "run", "simulate_arguments", "simulate_main"]

#: Passed on to the command when a process sent them to this one.
FORWARDED = (
    signal.SIGINT,
    signal.SIGTERM,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)
#: Sent by the terminal to its whole foreground process group, the command included.
FROM_TERMINAL = (signal.SIGINT, signal.SIGQUIT, signal.SIGHUP)
#: ``si_code`` of a signal the kernel raised (a terminal's Ctrl-C): not from a process.
SI_KERNEL = 0x80
#: Exit codes as a shell gives them: not executable, not found.
NOT_EXECUTABLE, NOT_FOUND = 126, 127


class BadSimulation(ValueError):
    """Options ``fake_gpus`` refused (or a simulation already active here): nothing ran."""


@dataclass(frozen=True)
class Simulation:
    """What ``fake_gpus`` is given: the command line's options, checked by it."""

    count: int
    memory: list[str] = field(default_factory=lambda: ["16GiB"])
    names: list[str] | None = None
    capability: list[str] | None = None
    context_memory: str = "64MiB"
    process_memory: bool = True
    pid_offset: int = 0
    mig: list[str] | None = None

    def options(self) -> dict[str, Any]:
        """``fake_gpus`` keyword arguments; one value for all devices or one per device."""
        return {
            "count": self.count,
            "memory": self.memory[0] if len(self.memory) == 1 else self.memory,
            "names": self.names[0] if self.names and len(self.names) == 1 else self.names,
            **_one_or_each("capability", self.capability),
            "context_memory": self.context_memory,
            "process_memory": self.process_memory,
            "pid_offset": self.pid_offset,
            "mig": self.mig,
        }


def _one_or_each(name: str, values: list[str] | None) -> dict[str, Any]:
    """A ``fake_gpus`` argument given once for all devices or once per device; absent
    when not given (its default)."""
    if not values:
        return {}
    return {name: values[0] if len(values) == 1 else values}


def run(simulation: Simulation, command: Sequence[str]) -> int:
    """Run ``command`` on the simulated GPUs; its exit code (128 + N if signal N ended
    it, as a shell says). Options ``fake_gpus`` refuses raise :class:`BadSimulation`
    with its message, naming the value, before anything starts."""
    from accelsched.testing import fake_gpus

    with ExitStack() as session:
        try:
            session.enter_context(fake_gpus(**simulation.options()))
        except (TypeError, ValueError, RuntimeError) as exc:  # RuntimeError: nested
            raise BadSimulation(str(exc).removeprefix("fake_gpus: ")) from None
        return _run_forwarding(list(command))


def _run_forwarding(command: list[str]) -> int:
    """Start ``command`` with every forwarded signal blocked here (none is lost between
    the start and the wait), take them with their sender, pass on those a process sent."""
    waited = {*FORWARDED, signal.SIGCHLD}
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, waited)
    try:
        try:
            child = subprocess.Popen(
                command, preexec_fn=lambda: signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
            )
        except FileNotFoundError:
            print(f"accelsched simulate: {command[0]}: command not found", file=sys.stderr)
            return NOT_FOUND
        except OSError as exc:  # no permission, no interpreter line, not an executable
            print(f"accelsched simulate: {command[0]}: {exc.strerror}", file=sys.stderr)
            return NOT_EXECUTABLE
        while (code := child.poll()) is None:
            info = signal.sigtimedwait(waited, 1.0)  # SIGCHLD wakes it when the child ends
            if info is None or info.si_signo == signal.SIGCHLD:
                continue
            if info.si_signo in FROM_TERMINAL and info.si_code == SI_KERNEL:
                continue  # the terminal sent it to the child too
            with suppress(ProcessLookupError):  # it ended meanwhile
                child.send_signal(info.si_signo)
        return code if code >= 0 else 128 - code
    finally:
        # signals still pending here were meant for a child that has ended
        while signal.sigtimedwait(waited, 0) is not None:
            pass
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)


# --- the command line (declared in accelsched.cli) ---------------------------------------


def simulate_arguments(command: argparse.ArgumentParser) -> None:
    """The options of ``fake_gpus`` that a command line can carry."""
    command.add_argument(
        "--gpus",
        required=True,
        type=_gpu_count,
        metavar="N",
        help=f"how many simulated GPUs (1 to {MAX_DEVICES})",
    )
    command.add_argument(
        "--memory",
        action="append",
        type=_size,
        metavar="SIZE",
        help="each GPU's memory, e.g. 16GiB (default); repeat it once per GPU to differ",
    )
    command.add_argument(
        "--name",
        action="append",
        dest="names",
        metavar="NAME",
        help="the GPUs' name (default 'NVIDIA Simulated GPU'); repeat it once per GPU to differ",
    )
    command.add_argument(
        "--capability",
        action="append",
        metavar="MAJOR.MINOR",
        help="the CUDA compute capability NVML reports (default 9.0); repeat it once per GPU "
        "to differ",
    )
    command.add_argument(
        "--context-memory",
        default="64MiB",
        type=_size,
        metavar="SIZE",
        help="what a CUDA context costs a process on a GPU (default 64MiB)",
    )
    command.add_argument(
        "--no-process-memory",
        dest="process_memory",
        action="store_false",
        help="NVML reports per-process memory as not available",
    )
    command.add_argument(
        "--pid-offset",
        default=0,
        type=_pid_offset,
        metavar="N",
        help="reported pid = real pid + N, as in a container without the host PID namespace",
    )
    command.add_argument(
        "--mig",
        type=_profiles,
        metavar="PROFILES",
        help="every GPU in MIG mode with these MIG devices, e.g. 3g.40gb,3g.40gb",
    )
    command.add_argument(
        "argv", nargs=argparse.REMAINDER, metavar="-- COMMAND", help="the command to run"
    )


def simulate_main(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    command = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not command:
        parser.error("no command to run: give it after --, e.g. -- dask worker tcp://...")
    simulation = Simulation(
        count=args.gpus,
        memory=args.memory or ["16GiB"],
        names=args.names,
        capability=args.capability,
        context_memory=args.context_memory,
        process_memory=args.process_memory,
        pid_offset=args.pid_offset,
        mig=args.mig,
    )
    try:
        return run(simulation, command)
    except BadSimulation as exc:  # fake_gpus names its own arguments: name the options
        message = str(exc)
        for argument, option in _SIMULATE_OPTIONS.items():
            if message.startswith(argument + " "):
                message = option + message[len(argument) :]
        parser.error(message)


#: ``fake_gpus`` arguments and the ``simulate`` options that give them.
_SIMULATE_OPTIONS = {
    "memory": "--memory",
    "names": "--name",
    "capability": "--capability",
    "context_memory": "--context-memory",
}


def _gpu_count(value: str) -> int:
    try:
        count = int(value)
    except ValueError:
        count = 0
    if not 1 <= count <= MAX_DEVICES:
        raise argparse.ArgumentTypeError(
            f"invalid --gpus {value!r}: expected a whole number from 1 to {MAX_DEVICES}"
        )
    return count


def _size(value: str) -> str:
    """A size ``fake_gpus`` takes (``16GiB``, bytes), checked with its own parser."""
    try:
        _parse_size(value, "size")
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid size {value!r}: expected bytes or a size like 16GiB"
        ) from None
    return value


def _pid_offset(value: str) -> int:
    try:
        return _check_pid_offset(int(value))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid --pid-offset {value!r}: expected a whole number from 0 to 2**31 - 1"
        ) from None


def _profiles(value: str) -> list[str]:
    """``--mig``: comma-separated MIG profiles (checked by ``fake_gpus`` with the GPUs)."""
    profiles = [p.strip() for p in value.split(",")]
    if not all(profiles):
        raise argparse.ArgumentTypeError(
            f"invalid --mig {value!r}: expected MIG profiles separated by commas, e.g. 3g.40gb"
        )
    return profiles
