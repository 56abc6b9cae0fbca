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

import signal
import subprocess
import sys
from collections.abc import Sequence
from contextlib import ExitStack, suppress
from dataclasses import dataclass, field
from typing import Any

__all__ = ["BadSimulation", "Simulation", "run"]

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
            "context_memory": self.context_memory,
            "process_memory": self.process_memory,
            "pid_offset": self.pid_offset,
            "mig": self.mig,
        }


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
        except PermissionError as exc:
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
