"""The NVML backend of the simulated GPUs, named by :func:`accelsched.testing.fake_gpus`.

accelsched reads NVML through the module ``ACCELSCHED_NVML_BACKEND`` (or dask config
``accelsched.nvml-backend``) names, ``pynvml`` by default. A ``fake_gpus`` session sets
the variable to this one for its process and every process it starts: the real
``pynvml`` over the fake ``libnvidia-ml.so.1``, or the pure-Python stand-in where the
library could not be built. Its :data:`CUDA` says what a task finds on these devices.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from accelsched.devices import Cuda, MemoryCap

#: What ``fake_gpus`` sets ``accelsched.nvml-backend`` to.
NAME = __name__


def api() -> Any:
    """pynvml's functions for the simulated devices: the stand-in where ``fake_gpus``
    chose it, the real pynvml (over the fake library) otherwise."""
    from accelsched.testing import standin

    if standin.active():
        return standin
    import pynvml

    return pynvml


class SimulatedCuda(Cuda):
    """No CUDA device exists behind a simulated GPU: none is made current, and a task
    computes with numpy (the devices account for memory, they run no kernels)."""

    def use(self, device: int) -> None:
        return None

    def count(self, cap: MemoryCap) -> None:
        """``device_alloc`` counts against the task's cap itself."""
        return None

    def array_module(self) -> ModuleType:
        import numpy

        return numpy


CUDA = SimulatedCuda()
