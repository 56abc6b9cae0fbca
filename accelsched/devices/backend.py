"""Which NVML library accelsched reads, and what CUDA its devices run: the backend,
passed in by name.

A backend is a module with pynvml's functions (``pynvml`` by default, what NVIDIA's
``nvidia-ml-py`` installs), or one whose ``api()`` returns them. Its ``CUDA`` (a
:class:`Cuda`) says how a task's device is made current and which array module a task
computes with there; a backend without one has CuPy's. So the simulated GPUs of
:mod:`accelsched.testing` bring their own (no CUDA call, numpy), and nothing else in
accelsched asks whether devices are simulated. The environment variable
``ACCELSCHED_NVML_BACKEND`` names the backend, else dask config ``accelsched.nvml-backend``.
The environment wins because it is what a process tree was started with: every process
started inside :func:`accelsched.testing.fake_gpus` (or ``accelsched simulate``) inherits
the session's backend, whatever config a harness or a nanny hands its workers
(distributed's test clusters restore a config snapshot; a nanny passes its own config
down). Production code names no test module.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from accelsched.devices.memory_cap import MemoryCap

__all__ = ["BACKEND_ENV", "BACKEND_KEY", "Cuda", "backend_module", "cuda", "load_backend"]

#: The config key naming the NVML backend module.
BACKEND_KEY = "accelsched.nvml-backend"
#: The environment variable naming it, before the config.
BACKEND_ENV = "ACCELSCHED_NVML_BACKEND"


def backend_module() -> ModuleType:
    """This process's backend module (the environment's, else the config's).
    ``ImportError`` when it is not installed, ``ValueError`` naming a value that is no
    module name."""
    name, where = os.environ.get(BACKEND_ENV), BACKEND_ENV
    if not name:
        from accelsched.config import config_value

        name, where = config_value(BACKEND_KEY), f"dask config {BACKEND_KEY}"
    if not isinstance(name, str) or not name.replace(".", "").replace("_", "").isalnum():
        raise ValueError(f"{where}: {name!r} is no module name")
    return importlib.import_module(name)


def load_backend() -> Any:
    """The NVML API of this process's backend (see :func:`backend_module`)."""
    module = backend_module()
    api = getattr(module, "api", None)
    return api() if callable(api) else module


class Cuda:
    """CUDA as a task sees it on the GPUs of a backend: real ones, through CuPy."""

    def use(self, device: int) -> Callable[[], Any] | None:
        """Make ``device`` CUDA's current one in this thread; a callable restoring the
        one before (None: nothing to restore, as where CuPy is not installed)."""
        try:
            import cupy
        except ImportError:
            return None
        runtime = cupy.cuda.runtime
        before = runtime.getDevice()
        runtime.setDevice(device)
        return lambda: runtime.setDevice(before)

    def count(self, cap: MemoryCap) -> Callable[[], Any] | None:
        """Count this thread's allocations against ``cap`` (refusing those past it under
        ``enforce``) until the callable returned is called; None: nothing to undo, as
        where CuPy is not installed. CuPy's allocator is set for this thread alone."""
        try:
            import cupy
        except ImportError:
            return None
        from accelsched.devices.memory_cap import counted_allocator

        scope = cupy.cuda.using_allocator(counted_allocator(cap, cupy.cuda.get_allocator()))
        scope.__enter__()
        return lambda: scope.__exit__(None, None, None)

    def array_module(self) -> ModuleType:
        """The module a task holding one of these devices computes with."""
        import cupy

        return cupy


_REAL = Cuda()


def cuda() -> Cuda:
    """The ``CUDA`` of this process's backend. A backend that cannot be loaded shows no
    GPU (the monitor says why), so no task holds one: CuPy's, never asked."""
    try:
        return getattr(backend_module(), "CUDA", _REAL)  # type: ignore[no-any-return]
    except (ImportError, ValueError):
        return _REAL
