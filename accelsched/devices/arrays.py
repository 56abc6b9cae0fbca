"""How many device bytes a Python object keeps alive, and on which device.

The leak estimate subtracts device memory held by results still in a worker's memory.
A result's device footprint is asked once, when it enters or leaves the worker's data,
through this dispatch: CuPy arrays are known, the simulated buffers of
:mod:`accelsched.testing` register themselves, and users can register their own types
(``device_nbytes.register(MyType)(fn)``) returning ``{device: nbytes}``.
"""

from __future__ import annotations

import copy
from typing import Any

from dask.utils import Dispatch

__all__ = ["device_nbytes", "to_host"]

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
    if isinstance(obj, list):
        return items if type(obj) is list else type(obj)(items)
    if hasattr(obj, "_fields"):  # a namedtuple
        return type(obj)(*items)
    return type(obj)(items)


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


@device_nbytes.register(object)
def _host_only(obj: Any) -> dict[int, int]:
    return {}


#: Containers longer than this are scanned only when their first item is on a device:
#: the guard asks at every task's end, on the worker's event loop.
SCAN_LIMIT = 32


@device_nbytes.register((list, tuple, set, frozenset))
def _sequence(obj: Any) -> dict[int, int]:
    items = obj if isinstance(obj, (list, tuple)) else list(obj)
    if len(items) > SCAN_LIMIT and (not items or not device_nbytes(items[0])):
        return {}
    out: dict[int, int] = {}
    for item in items:
        for dev, n in device_nbytes(item).items():
            out[dev] = out.get(dev, 0) + n
    return out


@device_nbytes.register(dict)
def _mapping(obj: dict) -> dict[int, int]:
    return _sequence(list(obj.values()))


@device_nbytes.register_lazy("cupy")
def _register_cupy() -> None:
    import cupy

    @device_nbytes.register(cupy.ndarray)
    def _cupy_array(arr: Any) -> dict[int, int]:
        base = arr.base if arr.base is not None else arr
        return {int(arr.device.id): int(base.data.mem.size)}
