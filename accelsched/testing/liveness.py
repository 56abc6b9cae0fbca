"""Whether the process that wrote a memory record still runs.

The driver frees a process's device memory when it ends, so the fake NVML counts a
record (``proc/<pid>`` in the state directory, :mod:`accelsched.testing.state`) only
while its writer runs: not for a dead pid, not for a zombie (it has exited; the driver
does not wait for its reaping), and not for a later process on a reused pid (pids wrap,
within minutes where ``pid_max`` is 32768). A record carries its writer's start time for
that; ``fakenvml.c`` makes the same checks. (A process whose main thread has exited
while other threads run shows as a zombie too: such a process is taken as ended.)
"""

from __future__ import annotations

import errno
import os

__all__ = ["HAS_PROC", "alive", "exists", "writer_start"]


#: Whether this system has Linux's ``/proc`` (else liveness is what ``kill`` says).
HAS_PROC = os.path.exists("/proc/self/stat")


def _stat(pid: int) -> tuple[str, int] | None:
    """``pid``'s state letter and start time (clock ticks since boot) from Linux's
    ``/proc/<pid>/stat``; ``("X", 0)`` (dead) where ``/proc`` exists but holds no such
    process (it ended after ``kill`` saw it); None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
        fields = data[data.rindex(b")") + 2 :].split()  # after the command, which may hold ")"
        return fields[0].decode(), int(fields[19])
    except FileNotFoundError:
        return ("X", 0) if HAS_PROC else None
    except (OSError, ValueError, IndexError):
        return None


_WRITER: dict[int, int] = {}


def writer_start(pid: int) -> int | None:
    """The start time of the process writing its own record: read once, as it
    publishes on every allocation (not remembered when it could not be read; forgotten
    in a forked child)."""
    started = _WRITER.get(pid)
    if started is None:
        stat = _stat(pid)
        if stat is None or stat[0] == "X":
            return None
        started = _WRITER[pid] = stat[1]
    return started


os.register_at_fork(after_in_child=_WRITER.clear)


def exists(pid: int) -> bool:
    """Whether there is a process ``pid`` (EPERM: one of another user), zombies too."""
    try:
        os.kill(pid, 0)
    except OSError as e:
        return e.errno != errno.ESRCH
    return True


def alive(pid: int, started: int | None = None) -> bool:
    """Whether ``pid`` runs (EPERM means it runs under another user), is no zombie, and,
    given ``started``, is the process that started then (not a later one on its pid)."""
    if not exists(pid):
        return False
    stat = _stat(pid)
    if stat is None:  # no /proc: what kill says
        return True
    return stat[0] not in ("Z", "X") and (started is None or stat[1] == started)
