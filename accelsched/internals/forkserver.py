"""Worker processes forked from a warm server: a nanny's restart in a fraction of a second.

:class:`FastRestart` is a nanny plugin (``distributed.diagnostics.plugin.NannyPlugin``)
that switches its nanny's process to ``multiprocessing``'s ``forkserver``.
:func:`accelsched.register` and ``dask scheduler --preload accelsched`` register it with
the GuardPlugin unless ``fast_restart`` is off. It acts on the nanny's *process*: every
nanny of that process (all of a ``LocalCluster``'s, which live in the client's process)
starts its workers this way while one of them has the plugin; the method is restored
once the last one closes. A worker process a nanny started before the plugin arrived is
replaced, at its next restart, by a forked one.

A nanny starts its worker process with ``multiprocessing``'s start method named by
``distributed.worker.multiprocessing-method`` (``spawn`` by default): a new interpreter
that imports distributed, dask and accelsched again, and whose predecessor ends with a
full interpreter shutdown. With ``forkserver``, a server process started once imports
them and forks each new worker process from itself: the imports are paid once, and a
forked child ends with ``os._exit``.

Nothing in the server may initialise CUDA: a CUDA context does not survive ``fork``. The
server imports only distributed's list (distributed, dask, numpy, pandas, lz4, ...),
accelsched and pynvml (which loads no library until ``nvmlInit``, and NVML is no CUDA
context anyway); never CuPy, RMM, numba or cudf. ``tests/as_users/test_fast_restart.py`` checks it.

What the server's children inherit is the server's environment, as it was when it
started, plus the nanny's ``env``: so the server is started again whenever the nanny
process's environment differs from the one it was started with (fake GPUs of another
``fake_gpus`` session, another ``LD_LIBRARY_PATH``).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
from multiprocessing import forkserver
from typing import Any

import dask.config
from distributed.diagnostics.plugin import NannyPlugin

from accelsched.protocol import FAST_RESTART_PLUGIN

__all__ = ["FastRestart", "PRELOAD", "METHOD_KEY"]

logger = logging.getLogger("accelsched.internals")

METHOD_KEY = "distributed.worker.multiprocessing-method"
#: What the server imports besides distributed's own list. No CUDA library here.
PRELOAD = (
    "accelsched",
    "accelsched.worker.leak_check",
    "accelsched.devices",
    "pynvml",
    # forked workers start while their GPU fails NVML (distributed's diagnostics)
    "accelsched.internals.started_despite_gpu_faults",
)

_lock = threading.Lock()
_users: set[int] = set()  # nannies of this process that use the server
_saved: list[Any] = []  # the dask.config.set that switched the method, to undo
_started: dict[str, Any] = {}  # "env", "preload": what the server was started with


def available() -> bool:
    """The platform has a forkserver and ``multiprocessing`` and distributed still have
    what this module relies on (else restarts spawn, as without accelsched)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return False
    server = getattr(forkserver, "_forkserver", None)
    needed = ("_lock", "_preload_modules", "_forkserver_pid", "_forkserver_alive_fd")
    if server is None or not all(hasattr(server, n) for n in needed + ("ensure_running",)):
        logger.warning("accelsched: multiprocessing's forkserver changed; restarts spawn")
        return False
    from distributed import utils

    return callable(getattr(utils, "get_mp_context", None))


class FastRestart(NannyPlugin):
    """Start this nanny's next worker processes from a warm fork server."""

    name = FAST_RESTART_PLUGIN
    idempotent = True

    def setup(self, nanny: Any) -> None:
        """From now on, ``nanny`` (and every nanny of this process) starts its worker
        processes from the fork server; start the server now, so that it has imported
        everything before the first restart."""
        if not available():
            logger.info("accelsched: no forkserver start method here; restarts spawn")
            return
        with _lock:
            if not _users:
                _saved.append(dask.config.set({METHOD_KEY: "forkserver"}))
            _users.add(id(nanny))
            _ensure_server()

    def teardown(self, nanny: Any) -> None:
        """``nanny`` closed: once no nanny of this process uses it, the method is what it
        was (the server lives on, idle, until this process exits)."""
        with _lock:
            _users.discard(id(nanny))
            if not _users and _saved:
                _saved.pop().__exit__(None, None, None)


def _ensure_server() -> None:
    from distributed.utils import get_mp_context

    ctx = get_mp_context()  # distributed sets its own preload list, once per process
    server: Any = forkserver._forkserver
    modules = list(server._preload_modules)
    wanted = modules + [m for m in PRELOAD if m not in modules]
    env = dict(os.environ)
    stale = _started.get("env") != env or _started.get("preload") != wanted
    if server._forkserver_pid is not None and stale:
        # forget the running server; the next start makes a new one. The old one exits
        # once the worker processes it forked have (each holds its liveness pipe, so
        # waiting for it here, as ``ForkServer._stop`` does, would wait for them), and is
        # reaped then
        logger.info("accelsched: starting the fork server again (environment or preload changed)")
        with server._lock:
            pid = server._forkserver_pid
            os.close(server._forkserver_alive_fd)
            server._forkserver_alive_fd = None
            server._forkserver_pid = None
            server._forkserver_address = None
        threading.Thread(target=os.waitpid, args=(pid, 0), daemon=True, name="reap").start()
    ctx.set_forkserver_preload(wanted)
    server.ensure_running()
    _started.update(env=env, preload=wanted)
