"""Which NVML library accelsched reads: the backend, passed in by name.

A backend is a module with pynvml's functions (``pynvml`` by default, what NVIDIA's
``nvidia-ml-py`` installs), or one whose ``api()`` returns them; ``SIMULATED = True`` in
it says its devices are simulated, so no CUDA call is made on them. The environment
variable ``ACCELSCHED_NVML_BACKEND`` names it, else dask config ``accelsched.nvml-backend``.
The environment wins because it is what a process tree was started with: every process
started inside :func:`accelsched.testing.fake_gpus` (or ``accelsched simulate``) inherits
the session's backend, whatever config a harness or a nanny hands its workers
(distributed's test clusters restore a config snapshot; a nanny passes its own config
down). Production code names no test module.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

__all__ = ["BACKEND_ENV", "BACKEND_KEY", "load_backend"]

#: The config key naming the NVML backend module.
BACKEND_KEY = "accelsched.nvml-backend"
#: The environment variable naming it, before the config.
BACKEND_ENV = "ACCELSCHED_NVML_BACKEND"


def load_backend(name: str | None = None) -> tuple[Any, bool]:
    """The NVML API of backend module ``name`` (the environment's, else the config's, when
    None), and whether its devices are simulated. ``ImportError`` when the module is not
    installed, ``ValueError`` naming a value that is no module name."""
    where = "the argument"
    if name is None and os.environ.get(BACKEND_ENV):
        name, where = os.environ[BACKEND_ENV], BACKEND_ENV
    elif name is None:
        from accelsched.config import config_value

        name, where = config_value(BACKEND_KEY), f"dask config {BACKEND_KEY}"
    if not isinstance(name, str) or not name.replace(".", "").replace("_", "").isalnum():
        raise ValueError(f"{where}: {name!r} is no module name")
    module = importlib.import_module(name)
    api = getattr(module, "api", None)
    return (api() if callable(api) else module), bool(getattr(module, "SIMULATED", False))
