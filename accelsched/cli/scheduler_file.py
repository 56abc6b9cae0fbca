"""``--scheduler-file PATH``: the scheduler's address from the file it writes.

``dask scheduler --scheduler-file PATH`` writes its identity there once it listens,
and ``dask worker --scheduler-file`` reads it; ``accelsched status`` and ``events``
read it the same way. The exit codes are :mod:`accelsched.observe.status_table`'s.
"""

from __future__ import annotations

import json
import os
import stat
import sys
import time
from typing import Final

from accelsched.observe.status_table import UNREACHABLE, USAGE, one_line, shown

__all__ = ["address_from_file", "MAX_SCHEDULER_FILE"]

#: A scheduler file is a few hundred bytes; anything this large is not one.
MAX_SCHEDULER_FILE: Final = 2**20


def address_from_file(path: str, deadline: float, command: str) -> str | int:
    """The address in a scheduler file (``dask scheduler --scheduler-file PATH``), or the
    exit code.

    The scheduler writes the file in place once it listens, so a reader can find it
    missing, empty or half written: it is waited for, then read with distributed's own
    reader, which tries again until it parses, until ``deadline`` (``time.monotonic``).
    A file that never appeared or is still empty then is :data:`UNREACHABLE` (the
    scheduler is not up yet); one that holds something else is :data:`USAGE`. Only a
    regular file of a sane size is opened: a FIFO would block and ``/dev/zero`` would
    never end."""
    while True:
        try:
            st = os.stat(path)
            break
        except FileNotFoundError:
            if time.monotonic() >= deadline:
                print(
                    f"accelsched {command}: no scheduler file at {shown(path)} "
                    "(is the scheduler started with --scheduler-file?)",
                    file=sys.stderr,
                )
                return UNREACHABLE
            time.sleep(0.05)
        except (OSError, ValueError) as exc:  # a symlink loop, a NUL in the path
            return _no_scheduler_file(command, path, one_line(exc))
    if not stat.S_ISREG(st.st_mode):
        return _no_scheduler_file(command, path, "not a regular file")
    if st.st_size > MAX_SCHEDULER_FILE:
        return _no_scheduler_file(command, path, f"{st.st_size} bytes")
    from accelsched.internals.client_side import read_json_file

    try:
        # distributed's reader takes a falsy document for one not written yet: wrapped
        # in a tuple, "{}" or "null" is judged at once, not waited on
        (cfg,) = read_json_file(
            path,
            load=lambda f: (json.load(f),),
            timeout=max(deadline - time.monotonic(), 0.01),  # at least one read
        )
    except TimeoutError:
        if _size(path) == 0:
            print(
                f"accelsched {command}: the scheduler file {shown(path)} is still empty "
                "(is the scheduler starting?)",
                file=sys.stderr,
            )
            return UNREACHABLE
        return _no_scheduler_file(command, path, "it holds no JSON")
    except RecursionError:  # nested too deep to parse
        return _no_scheduler_file(command, path, "it holds no JSON")
    except OSError as exc:  # no permission
        return _no_scheduler_file(command, path, one_line(exc))
    address = cfg.get("address") if isinstance(cfg, dict) else None
    if isinstance(address, str) and address:
        return address
    return _no_scheduler_file(command, path, f"it names no address: {address!r}")


def _size(path: str) -> int | None:
    try:
        return os.path.getsize(path)
    except OSError:
        return None


def _no_scheduler_file(command: str, path: str, problem: str) -> int:
    print(f"accelsched {command}: {shown(path)} is no scheduler file ({problem})", file=sys.stderr)
    return USAGE
