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
process's environment differs from the one it was started with (another
``LD_LIBRARY_PATH``, read by the loader once), except in the values of :data:`PASSED`,
which a worker reads only once it runs: the nanny hands their values to the workers it
forks (its ``env``, applied first thing in the new process), so a test suite that starts
a ``fake_gpus`` session per test (and pytest, which names the test running in the
environment) does not start a server per test.

Forked worker processes start even while their GPU fails NVML (distributed's own diagnostics).

With ``distributed.diagnostics.nvml`` on (its default), every server builds a
``SystemMonitor`` in its constructor, which asks NVML about the process's first visible
GPU (``nvml.one_time()``: handle, total memory, name) and reads it once
(``nvml.real_time()``). distributed catches only ``NVMLError_NotSupported`` there, so a
device that fails NVML at that moment (``NVMLError_Unknown``, ``NVMLError_GpuIsLost``)
raises out of ``Worker.__init__``: the nanny reports ``nanny-instantiate-failed`` and
the worker never comes back. A process that is already running only logs the monitor's
later errors and serves on.

distributed has one answer of its own to an NVML it cannot use: when ``nvmlInit``
raises ``NVMLError_Unknown`` it sets ``NVMLState.DISABLED_LIBRARY_NOT_FOUND`` and the
process runs without GPU diagnostics. :func:`start_despite_failing_gpu` extends that
answer to the device query at start: distributed's ``init_once`` is wrapped so that,
right after it first initialises NVML in a process, it asks the first visible device
what the monitor will ask; if NVML raises, the process is put in that same state (and
the GPU metrics ``init_once`` just added are taken back), so the monitor sees no GPU and
the worker starts. Nothing changes where the device answers. The cost: that process has
no GPU figures in distributed's dashboard; accelsched's own guard reads the device
itself and brings it back when it answers.

It must act before ``Worker.__init__``, where no preload or plugin runs yet: the fork
server that starts a nanny's worker processes (``fast_restart``) imports
:mod:`.started_despite_gpu_faults`, so every worker process forked from it has the
wrapper. The wrapper loads no NVML until distributed itself initialises it.
``check_worker`` verifies what it relies on.
"""

from __future__ import annotations

import functools
import logging
import multiprocessing
import os
import threading
from collections.abc import Callable
from multiprocessing import forkserver
from typing import Any

import dask.config
from distributed.diagnostics import nvml
from distributed.diagnostics.plugin import NannyPlugin

from accelsched.protocol import FAST_RESTART_PLUGIN

__all__ = ["FastRestart", "PASSED", "PRELOAD", "METHOD_KEY", "start_despite_failing_gpu", "NEEDED"]

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

#: Variables a worker reads only once it runs, never at its process's start: the simulated
#: GPUs' session (:mod:`accelsched.testing`, read at each NVML query), the NVML backend's
#: name (read as a task starts) and pytest's current test. Only whether they are set
#: decides whether the server starts again.
PASSED = (
    "ACCELSCHED_FAKE_NVML_DIR",
    "ACCELSCHED_FAKE_NVML_STANDIN",
    "ACCELSCHED_NVML_BACKEND",
    "PYTEST_CURRENT_TEST",
)

_lock = threading.Lock()
_users: set[int] = set()  # nannies of this process that use the server
_handed: dict[int, dict[str, str]] = {}  # nanny -> the PASSED values set in its env
_saved: list[Any] = []  # the dask.config.set that switched the method, to undo
_started: list[Any] = []  # (environment, preload): what the server was started with


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
            from distributed.utils import get_mp_context

            # the server, started now (or again where the environment or the preload
            # changed). distributed sets its own preload list, once per process
            ctx = get_mp_context()
            server: Any = forkserver._forkserver
            wanted = list(dict.fromkeys([*server._preload_modules, *PRELOAD]))  # ours after
            handing = isinstance(getattr(nanny, "env", None), dict)  # (Nanny.env: internals)
            started = (_environment(PASSED if handing else ()), wanted)
            if server._forkserver_pid is not None and _started != [started]:
                # forget the running server; the next start makes a new one. The old one
                # exits once the worker processes it forked have (each holds its liveness
                # pipe, so waiting for it here, as ``ForkServer._stop`` does, would wait
                # for them), and is reaped then
                logger.info(
                    "accelsched: starting the fork server again (environment or preload changed)"
                )
                with server._lock:
                    pid = server._forkserver_pid
                    os.close(server._forkserver_alive_fd)
                    server._forkserver_alive_fd = server._forkserver_pid = None
                    server._forkserver_address = None
                threading.Thread(target=os.waitpid, args=(pid, 0), daemon=True, name="reap").start()
            ctx.set_forkserver_preload(wanted)
            server.ensure_running()
            _started[:] = [started]
            if handing:
                _hand_over(nanny)

    def teardown(self, nanny: Any) -> None:
        """``nanny`` closed: once no nanny of this process uses it, the method is what it
        was (the server lives on, idle, until this process exits)."""
        with _lock:
            _users.discard(id(nanny))
            for name, value in _handed.pop(id(nanny), {}).items():
                if nanny.env.get(name) == value:  # (a spawned worker inherits them)
                    del nanny.env[name]
            if not _users and _saved:
                _saved.pop().__exit__(None, None, None)


def _environment(passed: tuple[str, ...]) -> dict[str, str | bool]:
    """This process's environment as the server's must match it: ``passed`` by presence."""
    return {k: True if k in passed else v for k, v in os.environ.items()}


def _hand_over(nanny: Any) -> None:
    """``nanny``'s next workers get the :data:`PASSED` values now in effect, not those the
    server started with (a value the nanny's own ``env`` names wins, as it would anyway)."""
    env = nanny.env
    for name, value in _handed.pop(id(nanny), {}).items():  # set up before: values anew
        if env.get(name) == value:
            del env[name]
    handed = {k: os.environ[k] for k in PASSED if k in os.environ and k not in env}
    env.update(handed)
    _handed[id(nanny)] = handed


#: What the wrapper relies on in ``distributed.diagnostics.nvml``.
NEEDED = ("init_once", "is_initialized", "device_get_count", "one_time", "real_time")


def missing() -> list[str]:
    """What of :data:`NEEDED` (and the state it sets) distributed no longer has."""
    gone = [f"distributed.diagnostics.nvml.{n} is gone" for n in NEEDED if not hasattr(nvml, n)]
    state = getattr(nvml, "NVMLState", None)
    if not hasattr(nvml, "NVML_STATE") or not hasattr(state, "DISABLED_LIBRARY_NOT_FOUND"):
        gone.append("distributed.diagnostics.nvml.NVML_STATE/NVMLState changed")
    return gone


def start_despite_failing_gpu() -> bool:
    """Wrap distributed's ``init_once`` in this process (idempotent); False, and nothing
    changed, where distributed no longer has what the wrapper relies on."""
    if missing():
        logger.warning("accelsched: distributed's NVML diagnostics changed; not wrapped")
        return False
    original: Callable[[], None] = nvml.init_once
    if getattr(original, "accelsched_wrapped", False):
        return True

    @functools.wraps(original)
    def init_once() -> None:
        fresh = not nvml.is_initialized()
        original()
        if fresh and nvml.is_initialized():
            # ask the first visible device what ``SystemMonitor`` will; if NVML raises,
            # run this process without distributed's GPU diagnostics, as after a failed
            # ``nvmlInit``
            import pynvml

            try:
                if nvml.device_get_count() > 0:  # initialised now: the wrapper returns at once
                    nvml.one_time()
                    nvml.real_time()
            except pynvml.NVMLError as exc:
                nvml.NVML_STATE = nvml.NVMLState.DISABLED_LIBRARY_NOT_FOUND
                from distributed import worker

                worker.DEFAULT_METRICS.pop("gpu", None)  # added by init_once a moment ago
                worker.DEFAULT_STARTUP_INFORMATION.pop("gpu", None)
                logger.warning(
                    "accelsched: the first visible GPU does not answer NVML (%r); this process "
                    "runs without distributed's GPU diagnostics so that it can start",
                    exc,
                )

    init_once.accelsched_wrapped = True  # type: ignore[attr-defined]
    nvml.init_once = init_once
    return True
