"""Which NVML library accelsched reads: the backend, passed in by name.

dask config ``accelsched.nvml-backend`` names a module with pynvml's functions
(``pynvml`` by default, what NVIDIA's ``nvidia-ml-py`` installs). A backend module may
instead give them through ``api()``, and says ``SIMULATED = True`` when its devices are
simulated, so no CUDA call is made on them: :func:`accelsched.testing.fake_gpus` names
its own in every process of a session. Production code names no test module.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["BACKEND_KEY", "load_backend"]

#: The config key naming the NVML backend module.
BACKEND_KEY = "accelsched.nvml-backend"


def load_backend(name: str | None = None) -> tuple[Any, bool]:
    """The NVML API of backend module ``name`` (the config's when None), and whether its
    devices are simulated. ``ImportError`` when the module is not installed."""
    if name is None:
        from accelsched.config import config_value

        name = config_value(BACKEND_KEY)
    if not isinstance(name, str) or not name:
        raise ValueError(f"dask config {BACKEND_KEY}: {name!r} is no module name")
    module = importlib.import_module(name)
    api = getattr(module, "api", None)
    return (api() if callable(api) else module), bool(getattr(module, "SIMULATED", False))
