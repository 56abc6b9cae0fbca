"""Argument checks for :func:`accelsched.testing.fake_gpus`: each error names the value."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from accelsched.config import size_bytes

#: The fake library's limit.
MAX_DEVICES = 64


def _check_count(count: int) -> int:
    if isinstance(count, bool) or not isinstance(count, int):
        raise TypeError(f"fake_gpus: count must be an int, got {count!r}")
    if not 0 <= count <= MAX_DEVICES:
        raise ValueError(f"fake_gpus: count must be between 0 and {MAX_DEVICES}, got {count!r}")
    return count


#: The largest size NVML can report (an unsigned 64-bit count of bytes).
MAX_BYTES = 2**64 - 1


def _parse_size(value: int | str, what: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(f"fake_gpus: {what} must be bytes (int) or a size string, got {value!r}")
    size = value if isinstance(value, int) else size_bytes(value)
    if size is None:  # "", "GiB" (dask: one of the unit), "1.5" (dask: one byte)
        raise ValueError(f"fake_gpus: {what} is not a size in whole bytes: {value!r}")
    if size < minimum:
        raise ValueError(f"fake_gpus: {what} must be at least {minimum} bytes, got {value!r}")
    if size > MAX_BYTES:
        raise ValueError(
            f"fake_gpus: {what} must be at most {MAX_BYTES} bytes (what NVML can report), "
            f"got {value!r}"
        )
    return size


def _check_context(context: int, totals: Sequence[int], value: Any) -> int:
    """A CUDA context larger than a device could never be made there: every allocation
    on it would fail."""
    if totals and context > min(totals):
        raise ValueError(
            f"fake_gpus: context_memory {value!r} is more than a device's memory "
            f"({min(totals)} bytes)"
        )
    return context


def _check_name(value: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"fake_gpus: names must be strings, got {value!r}")
    # printable: no tab, no line break of any kind (a vertical tab, U+2028: the state
    # files are read by lines), no NUL (the library's reader stops at it)
    if not value.strip() or not value.isprintable() or len(value.encode()) > 95:
        raise ValueError(
            f"fake_gpus: a name must be non-empty, one line without tabs, "
            f"at most 95 bytes; got {value!r}"
        )
    return value


def _check_capability(value: str) -> tuple[int, int]:
    """``"8.0"``: a CUDA compute capability, major.minor."""
    major, dot, minor = value.partition(".") if isinstance(value, str) else ("", "", "")
    digits = (major + minor).isascii() and major.isdigit() and minor.isdigit()  # not '²'
    if not (dot and digits and len(major + minor) <= 4):
        raise ValueError(
            f"fake_gpus: capability must be 'major.minor' such as '8.0', got {value!r}"
        )
    return int(major), int(minor)


def _check_bool(value: bool, what: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"fake_gpus: {what} must be True or False, got {value!r}")
    return value


def _check_pid_offset(value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"fake_gpus: pid_offset must be an int, got {value!r}")
    if not 0 <= value < 2**31:
        raise ValueError(f"fake_gpus: pid_offset must be between 0 and 2**31, got {value!r}")
    return value


def _per_device(value: Any, count: int, what: str, check: Any) -> list[Any]:
    """One value for every device, or a sequence with one per device."""
    if isinstance(value, (str, int)):
        return [check(value)] * count
    if not isinstance(value, Sequence) or isinstance(value, (bytes, bytearray, memoryview)):
        # (bytes are a sequence: b"16GiB" would be five devices of 49, 54, ... bytes)
        raise TypeError(f"fake_gpus: {what} must be one value or a sequence, got {value!r}")
    if len(value) != count:
        raise ValueError(
            f"fake_gpus: {what} must be one value or a sequence of {count} (one per "
            f"device), got {value!r}"
        )
    return [check(v) for v in value]
