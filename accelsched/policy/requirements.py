"""What a GPU task needs: a count of GPUs, and of each device memory, model, capability, MIG.

A count says how many devices (:func:`invalid_amount` refuses what is none); a
:class:`Requirement` says which devices will do and how much of one a task takes.
Written on a step (``@gpu(memory="24GiB", model="H100*")``) or as an annotation
(``dask.annotate(gpu={"memory": "24GiB"})``), checked where it is written and again
where it is unpickled (the scheduler trusts no pickle), and compared against what NVML
verified of each device (:class:`DeviceFacts`). Decisions only: no distributed import.

- ``memory``: device memory the task needs (bytes; ``"24GiB"``). Tasks that declare it
  share a device while their declared needs fit in it (:func:`pack`); a device whose
  :func:`capacity` (its memory less a reserve) is smaller than the need is never eligible.
- ``model``: a shell pattern matched, case-insensitively, against the device's NVML
  name (``"*H100*"``, ``"NVIDIA A100*"``).
- ``capability``: the least CUDA compute capability, ``"8.0"`` or ``(8, 0)``.
- ``mig``: ``True`` for a MIG device only, ``False`` for a whole GPU only.
- ``enforce``: with ``memory``, whether an allocation past it fails
  (:mod:`accelsched.devices.gpu_memory`); None: the guard's ``enforce_memory`` says.
  It says nothing of the device, so placement and :meth:`Requirement.label` ignore it.
"""

from __future__ import annotations

import fnmatch
import math
import numbers
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from dask.utils import parse_bytes

from accelsched.devices.nvml import DeviceFacts

__all__ = [
    "KEYS",
    "invalid_amount",
    "Conflict",
    "DeviceFacts",
    "Requirement",
    "parse_requirement",
    "requirement_problem",
    "combine",
    "capacity",
    "mebibytes",
    "pack",
]

#: The keys a requirement may have; any other is refused, named.
KEYS = ("memory", "model", "capability", "mig", "enforce")
#: Most bytes a requirement may ask (1 EiB): more is a typo, not a device.
MAX_MEMORY = 1 << 60
#: Longest model pattern taken.
MAX_PATTERN = 200

_CAPABILITY = re.compile(r"^\s*(\d{1,3})\.(\d{1,3})\s*$")
#: A size in bytes with a fraction ("1.5", "0.5B"), which no allocation can be.
_FRACTION_OF_A_BYTE = re.compile(r"^\s*\d*\.\d*[1-9]\d*\s*[bB]?\s*$")


def invalid_amount(amount: Any) -> str | None:
    """Why ``resources={"GPU": amount}`` (or a step's count) cannot be placed, or None.

    Zero, negative, NaN and infinite amounts would match GPU-less or every worker in
    plain distributed, or none at all; they err instead, naming the value.
    """
    if (type(amount) is int or type(amount) is float) and 0 < amount < math.inf:
        return None  # the common case, without ABCs
    try:
        real = isinstance(amount, numbers.Real) and not isinstance(amount, bool)
        if real and 0 < float(amount) < math.inf:
            return None
    except (OverflowError, ValueError):
        pass
    return f"invalid resources={{'GPU': {amount!r}}}: expected a positive, finite number of GPUs"


@dataclass(frozen=True)
class Requirement:
    """What one GPU task needs of each device it holds; None: anything goes."""

    memory: int | None = None
    model: str | None = None
    capability: tuple[int, int] | None = None
    mig: bool | None = None
    enforce: bool | None = None

    def __bool__(self) -> bool:
        return any(v is not None for v in (self.memory, self.model, self.capability, self.mig))

    def fits(self, device: DeviceFacts) -> bool:
        """Whether ``device`` can ever hold the task: its attributes, and for declared
        memory what tasks may declare there (:func:`capacity`), the one rule both the
        scheduler's eligibility and the worker's lease table go by."""
        return (
            (self.memory is None or capacity(device.memory) >= self.memory)
            and (
                self.model is None
                or fnmatch.fnmatchcase(device.name.casefold(), self.model.casefold())
            )
            and (
                self.capability is None
                or (device.capability is not None and device.capability >= self.capability)
            )
            and (self.mig is None or device.mig == self.mig)
        )

    def label(self) -> str:
        """A short, stable name for this requirement: events, status, resource names."""
        cc, mig = self.capability, self.mig
        parts = (
            "" if self.memory is None else f"memory>={_bytes_text(self.memory)}",
            "" if self.model is None else f"model={self.model}",
            "" if cc is None else f"capability>={cc[0]}.{cc[1]}",
            "" if mig is None else "mig" if mig else "whole-gpu",
        )
        return ",".join(p for p in parts if p) or "any"


def _bytes_text(n: int) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return f"{n}B"


def _memory(value: Any) -> int | None:
    if isinstance(value, str):
        if _FRACTION_OF_A_BYTE.match(value):  # "1.5": parse_bytes would take 1 byte
            return None
        try:
            value = parse_bytes(value)
        except (ValueError, TypeError, OverflowError):  # "1e400": past any float
            return None
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    return int(value) if ok and 0 < int(value) <= MAX_MEMORY else None


def _capability(value: Any) -> tuple[int, int] | None:
    if isinstance(value, str) and (m := _CAPABILITY.match(value)):
        return int(m.group(1)), int(m.group(2))
    if (
        isinstance(value, (tuple, list))
        and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1000 for v in value)
    ):
        return int(value[0]), int(value[1])
    return None


#: Per key: what reads a given value (None: not one), and what was expected instead.
_FIELDS: dict[str, tuple[Callable[[Any], Any], str]] = {
    "memory": (_memory, "expected whole bytes, 1 to 1 EiB, or a size such as '24GiB'"),
    "model": (
        lambda v: (
            v
            if isinstance(v, str) and v.strip() and len(v) <= MAX_PATTERN and v.isprintable()
            else None
        ),
        f"expected a name pattern such as '*H100*' (at most {MAX_PATTERN} characters, "
        "none unprintable)",
    ),
    "capability": (_capability, "expected 'major.minor' such as '8.0', or (8, 0)"),
    "mig": (
        lambda v: v if isinstance(v, bool) else None,
        "expected True (a MIG device) or False (a whole GPU)",
    ),
    "enforce": (
        lambda v: v if isinstance(v, bool) else None,
        "expected True (an allocation past memory= fails) or False",
    ),
}


def _shown(value: Any) -> str:
    """``repr(value)``, short: a bad value is named, not copied whole into the error."""
    try:
        text = repr(value)
    except ValueError:  # an int past the digits Python converts to text
        return f"<an integer of {int(value).bit_length()} bits>"
    return text if len(text) <= 80 else f"{text[:77]}..."


def parse_requirement(value: Any) -> Requirement:
    """A :class:`Requirement` from a mapping (an annotation, ``gpu(**kwargs)``), or one
    already built (checked again: it may come from a pickle). ``ValueError`` names the bad
    key or value; None and ``{}`` are "anything goes"."""
    if value is None:
        return Requirement()
    if isinstance(value, Conflict):
        raise ValueError(f"invalid GPU requirement: {value.label()}")
    if isinstance(value, Requirement):
        given: Mapping[str, Any] = {k: getattr(value, k) for k in KEYS}
    elif isinstance(value, Mapping):
        unknown = sorted(map(repr, set(value) - set(KEYS)))
        if unknown:
            raise ValueError(
                f"unknown GPU requirement key(s) {', '.join(unknown)}: expected {', '.join(KEYS)}"
            )
        given = value
    else:
        raise ValueError(
            f"invalid GPU requirement {value!r}: expected a mapping of {', '.join(KEYS)}"
        )
    parsed = {}
    for key in KEYS:
        if given.get(key) is not None:
            read, expected = _FIELDS[key]
            parsed[key] = read(given[key])
            if parsed[key] is None:
                raise ValueError(f"invalid GPU requirement {key}={_shown(given[key])}: {expected}")
    if "enforce" in parsed and "memory" not in parsed:
        raise ValueError(
            f"invalid GPU requirement enforce={parsed['enforce']!r} without memory: "
            "it holds a task to the memory it declares (memory='2GiB')"
        )
    return Requirement(**parsed)


def requirement_problem(value: Any) -> str | None:
    """Why ``value`` is no requirement, or None."""
    try:
        parse_requirement(value)
    except ValueError as exc:
        return str(exc)
    return None


@dataclass(frozen=True)
class Conflict(Requirement):
    """Requirements no one device can meet at once (steps fused into one task that ask
    for different models, or MIG and a whole GPU): the task errs, naming them."""

    text: str = ""

    def __bool__(self) -> bool:
        return True

    def fits(self, device: DeviceFacts) -> bool:
        return False

    def label(self) -> str:
        return f"conflicting: {self.text}"


def combine(requirements: list[Requirement]) -> Requirement | None:
    """What one task calling several marked steps needs: the most memory, the highest
    capability, enforced if one step enforces; models and MIG must agree (else a
    :class:`Conflict`)."""
    if not requirements:
        return None
    if len(requirements) == 1:
        return requirements[0]
    models = {r.model for r in requirements if r.model is not None}
    migs = {r.mig for r in requirements if r.mig is not None}
    if len(models) > 1 or len(migs) > 1:
        return Conflict(text=" and ".join(sorted({r.label() for r in requirements})))
    memories = [r.memory for r in requirements if r.memory is not None]
    capabilities = [r.capability for r in requirements if r.capability is not None]
    enforced = {r.enforce for r in requirements if r.enforce is not None}
    return Requirement(
        memory=max(memories) if memories else None,
        model=models.pop() if models else None,
        capability=max(capabilities) if capabilities else None,
        mig=migs.pop() if migs else None,
        enforce=max(enforced) if enforced else None,  # one step that enforces: enforced
    )


#: What a device keeps back from declared tasks: a twentieth of it, at most 2 GiB
#: (CUDA contexts, library handles, the allocator's slack).
RESERVE_FRACTION = 20
MAX_RESERVE = 2 << 30
MiB = 1 << 20


def capacity(memory: int) -> int:
    """Bytes tasks may declare on a device of ``memory`` bytes (what :func:`pack` fills)."""
    return max(0, memory - min(memory // RESERVE_FRACTION, MAX_RESERVE))


def share(memory: int, sharers: int = 1) -> int:
    """Bytes one of ``sharers`` workers driving a device of ``memory`` bytes may declare
    on it (``share_gpus``): its capacity divided equally, so that every worker packing
    its own share never packs the device past what it holds."""
    return capacity(memory) // max(1, sharers)


#: Results held on a device count against its room in steps of this fraction of it.
HELD_STEPS = 16


def held_counted(held: int, memory: int) -> int:
    """What results holding ``held`` bytes on a device of ``memory`` bytes take from the
    room a worker offers: rounded up to a sixteenth of the device (at least 1 MiB), so
    the figure the scheduler places against changes once per step, not with every
    result, and never says more room than there is."""
    if held <= 0:
        return 0
    step = max(MiB, memory // HELD_STEPS)
    return -(-held // step) * step


def mebibytes(nbytes: int) -> int:
    """A declared need as distributed's resource amount: whole MiB, rounded up."""
    return -(-nbytes // MiB)


def pack(
    need: int, devices: Iterable[tuple[int, int, int]], *, whole: Iterable[int] = ()
) -> int | None:
    """The device a task declaring ``need`` bytes goes to, or None when none has room.

    ``devices``: ``(index, capacity, leased)`` for each eligible device, capacity being
    what tasks may declare on it (its memory less a reserve), leased what running tasks
    declared there. ``whole``: devices a task without a memory declaration holds (they
    share with nobody). Best fit: the device left with the least room, so small tasks
    fill one device and leave another whole for a large one.
    """
    held = set(whole)
    left = [(room - leased - need, i) for i, room, leased in devices if i not in held]
    return min(((n, i) for n, i in left if n >= 0), default=(0, None))[1]
