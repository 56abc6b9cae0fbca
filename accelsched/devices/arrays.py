"""How many device bytes a Python object keeps alive, and on which device.

The leak estimate subtracts device memory held by results still in a worker's memory.
A result's device footprint is asked once, when it enters or leaves the worker's data,
through this dispatch: CuPy arrays are known, the simulated buffers of
:mod:`accelsched.testing` register themselves, and users can register their own types
(``device_nbytes.register(MyType)(fn)``) returning ``{device: nbytes}``.
"""

from __future__ import annotations

import copy
import math
from typing import Any

from dask.utils import Dispatch

__all__ = ["device_nbytes", "to_host", "knows", "GPU_LIBRARIES"]

device_nbytes = Dispatch(name="device_nbytes")

#: Copy a device object to the host (for a task that fell back to a CPU worker).
to_host = Dispatch(name="to_host")


@to_host.register(object)
def _already_host(obj: Any) -> Any:
    return obj


@to_host.register((list, tuple))
def _host_sequence(obj: Any) -> Any:
    items = [to_host(item) for item in obj]
    if all(new is old for new, old in zip(items, obj, strict=True)):
        return obj  # nothing on a device: the very same object
    # a namedtuple takes its fields one by one
    return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)


@to_host.register(dict)
def _host_mapping(obj: dict) -> dict:
    converted = {k: to_host(v) for k, v in obj.items()}
    if all(converted[k] is v for k, v in obj.items()):
        return obj
    out = copy.copy(obj)  # keeps defaultdict's factory, OrderedDict's order, ...
    out.update(converted)
    return out


@to_host.register_lazy("cupy")
def _register_cupy_to_host() -> None:
    import cupy

    @to_host.register(cupy.ndarray)
    def _cupy_to_host(arr: Any) -> Any:
        return cupy.asnumpy(arr)


#: Libraries whose objects hold device memory that dask's ``sizeof`` (their own
#: registrations) measures: a second source where no ``device_nbytes`` rule is registered.
GPU_LIBRARIES = frozenset({"cudf", "dask_cudf", "rmm", "torch", "cupy", "numba", "cuml"})


@device_nbytes.register(object)
def _by_protocol(obj: Any) -> dict[int, int]:
    """Objects with no registered rule: what their protocols or library tell.

    ``__cuda_array_interface__`` (numba, cupy-likes) and ``__dlpack_device__`` name device
    arrays; a type from a GPU library (cudf, rmm, torch, ...) is sized by dask's
    ``sizeof``, which those libraries register. Anything else holds nothing known.
    """
    device = _device_of(obj)
    if device is None:
        return {}
    nbytes = getattr(obj, "nbytes", None)
    if not isinstance(nbytes, int):
        interface: Any = getattr(obj, "__cuda_array_interface__", None)
        try:
            nbytes = math.prod(int(n) for n in interface["shape"]) * int(interface["typestr"][2:])
        except (KeyError, TypeError, ValueError):  # no interface, or not one
            nbytes = None
    if not isinstance(nbytes, int):
        from dask.sizeof import sizeof

        nbytes = int(sizeof(obj))
    return {device: nbytes} if nbytes > 0 else {}


def task_device() -> int | None:
    """The device an object whose device is not known is counted on: the running task's.
    :mod:`accelsched.context`, which keeps it (a layer above this one), replaces this."""
    return None


def _device_of(obj: Any) -> int | None:
    """The CUDA device ``obj`` lives on, or None when it is not known to be on one."""
    dlpack = getattr(obj, "__dlpack_device__", None)
    if callable(dlpack):
        try:
            kind, index = dlpack()
        except Exception:
            return None
        return int(index) if int(kind) in (2, 3, 13) else None  # CUDA, CUDA host, managed
    on_gpu = hasattr(obj, "__cuda_array_interface__") or (
        type(obj).__module__.split(".")[0] in GPU_LIBRARIES
    )
    if not on_gpu:
        return None
    device = getattr(getattr(obj, "device", None), "id", None)
    if isinstance(device, int):
        return device
    return task_device() or 0


#: Types known to hold no device memory: a result of one of these is fully accounted.
HOST_TYPES: tuple[type, ...] = (int, float, complex, str, bytes, bool, type(None))


def knows(value: Any) -> bool:
    """Whether ``device_nbytes(value)`` is knowledge rather than a shrug.

    True for registered types, host types (numpy, pandas, Python scalars) and objects a
    protocol describes; False for an object of a type nobody described (a cudf frame
    with no rule, say): its device memory, if any, is measured, and what dask's
    ``sizeof`` says of it (on the device the task held, else device 0) is only a guess.
    """
    if isinstance(value, HOST_TYPES):
        return True
    if hasattr(value, "__cuda_array_interface__") or hasattr(value, "__dlpack_device__"):
        return True  # the protocol tells where it lives and how big it is (host: nothing)
    if isinstance(value, (list, tuple)):
        return all(knows(v) for v in value[:SCAN_LIMIT])
    if isinstance(value, dict):
        return all(knows(v) for v in list(value.values())[:SCAN_LIMIT])
    if device_nbytes.dispatch(type(value)) is not _by_protocol:
        return True
    module = type(value).__module__.split(".")[0]
    return module in ("numpy", "pandas", "pyarrow", "scipy")


#: Containers longer than this are scanned only when their first item is on a device:
#: the guard asks at every task's end, on the worker's event loop.
SCAN_LIMIT = 32


@device_nbytes.register((list, tuple, set, frozenset, dict))
def _sequence(obj: Any) -> dict[int, int]:
    items = (
        obj
        if isinstance(obj, (list, tuple))
        else list(obj.values() if isinstance(obj, dict) else obj)
    )
    if len(items) > SCAN_LIMIT and (not items or not device_nbytes(items[0])):
        return {}
    out: dict[int, int] = {}
    for item in items:
        for dev, n in device_nbytes(item).items():
            out[dev] = out.get(dev, 0) + n
    return out


@device_nbytes.register_lazy("cupy")
def _register_cupy() -> None:
    import cupy

    @device_nbytes.register(cupy.ndarray)
    def _cupy_array(arr: Any) -> dict[int, int]:
        base = arr.base if arr.base is not None else arr
        return {int(arr.device.id): int(base.data.mem.size)}
