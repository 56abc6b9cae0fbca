"""A worker process starts even while its GPU fails NVML (distributed's own diagnostics).

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
server that starts a nanny's worker processes (:mod:`.forkserver`, ``fast_restart``)
imports this module, so every worker process forked from it has the wrapper. The wrapper
loads no NVML until distributed itself initialises it. ``check_worker`` verifies what
it relies on.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

from distributed.diagnostics import nvml

__all__ = ["start_despite_failing_gpu", "NEEDED"]

logger = logging.getLogger("accelsched.internals")

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
