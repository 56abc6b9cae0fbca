"""Options: dask config defaults, environment overrides, validated constructor arguments.

Every option of :class:`~accelsched.PlacementPlugin` and :class:`~accelsched.GuardPlugin`
has a dask config key under ``accelsched.`` (so ``DASK_ACCELSCHED__...`` environment
variables work); a constructor argument wins over config. Values are validated when a
plugin is constructed, on the client, so a typo fails there with the option and the value
named, not later inside a scheduler or a worker.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import dask.config
import yaml
from dask.utils import parse_bytes, parse_timedelta

__all__ = [
    "Option",
    "resolve_options",
    "config_value",
    "BUILTIN",
    "Threshold",
    "PLACEMENT_OPTIONS",
    "GUARD_OPTIONS",
]

_DEFAULTS = os.path.join(os.path.dirname(__file__), "accelsched.yaml")
with open(_DEFAULTS) as _f:
    _BUILTIN_TREE = yaml.safe_load(_f)
dask.config.update_defaults(_BUILTIN_TREE)


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


#: The built-in default of every key, kept apart from dask's config: a harness that
#: restores a config snapshot taken before accelsched was imported (distributed's own test
#: clusters do) removes the keys, and a key that is absent means its built-in default.
BUILTIN: dict[str, Any] = _flatten(_BUILTIN_TREE)


def config_value(key: str) -> Any:
    """``key``'s value in dask config, or its built-in default where the key is absent
    (only a present, bad value is an error, raised by the option's parser)."""
    return dask.config.get(key, BUILTIN[key])


@dataclass(frozen=True)
class Option:
    """One public option: its argument name, its config key and how to validate it."""

    name: str
    key: str
    parse: Callable[[str, Any], Any]


def resolve_options(
    options: tuple[Option, ...], given: Mapping[str, Any], owner: str
) -> dict[str, Any]:
    """Validated values for ``options``: arguments win over dask config."""
    known = {o.name for o in options}
    unknown = sorted(set(given) - known)
    if unknown:
        raise TypeError(
            f"{owner} got unknown option(s) {', '.join(map(repr, unknown))}; "
            f"valid options: {', '.join(sorted(known))}"
        )
    out: dict[str, Any] = {}
    for opt in options:
        value = given[opt.name] if opt.name in given else config_value(opt.key)
        out[opt.name] = opt.parse(opt.name, value)
    return out


# --- parsers: each takes (option name, raw value) and raises naming both ----------------


def _bad(name: str, value: Any, expected: str, exc: type[Exception] = ValueError) -> Exception:
    shown = repr(value)
    if len(shown) > 60:
        shown = shown[:40] + "..." + shown[-10:]
    return exc(f"invalid {name}={shown}: expected {expected}")


#: A duration string: a number (at least one digit), then an optional unit.
_DURATION = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?\s*[a-zA-Z]*$")

#: The shortest interval a periodic check may run at: faster only burns CPU.
MIN_INTERVAL = 0.01


def parse_optional_duration(name: str, value: Any) -> float | None:
    """None/False: never; 0: immediately; a number of seconds or a dask duration string."""
    expected = "a duration like '5s', a number of seconds, or None"
    if value is None or value is False:
        return None
    if value is True or not isinstance(value, (int, float, str)):
        raise _bad(name, value, expected, TypeError)
    value_: Any
    if isinstance(value, str):
        text = value.strip().removeprefix("+")
        if not _DURATION.match(text):  # "", "s", ".": no number at all
            raise _bad(name, value, expected)
        if text.startswith("-"):
            raise _bad(name, value, "a finite, non-negative duration")
        if text.startswith("."):  # dask reads ".5s" as "1.5s"
            text = "0" + text
        # dask knows "m" and "minutes" but not the common "min"/"mins"
        value_ = re.sub(r"(?<=[\d\s.])mins?$", "minutes", text)
    else:
        value_ = value
    try:
        seconds = float(parse_timedelta(value_, default="seconds"))
    except (ValueError, KeyError, TypeError, IndexError, OverflowError):
        raise _bad(name, value, expected) from None
    if not math.isfinite(seconds) or seconds < 0:
        raise _bad(name, value, "a finite, non-negative duration")
    return seconds


def parse_positive_duration(name: str, value: Any) -> float:
    seconds = parse_optional_duration(name, value)
    if seconds is None or seconds <= 0:
        raise _bad(name, value, "a positive duration like '250ms' or '1s'")
    return seconds


def parse_interval(name: str, value: Any) -> float:
    """A periodic check's interval: at least :data:`MIN_INTERVAL`."""
    seconds = parse_positive_duration(name, value)
    if seconds < MIN_INTERVAL:
        raise _bad(name, value, f"an interval of at least {MIN_INTERVAL * 1000:g}ms")
    return seconds


def parse_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise _bad(name, value, "True or False", TypeError)


def parse_count(name: str, value: Any) -> int:
    """A non-negative integer."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise _bad(name, value, "a non-negative integer", TypeError)
    try:
        n = int(value)
    except ValueError:
        raise _bad(name, value, "a non-negative integer") from None
    if n < 0:
        raise _bad(name, value, "a non-negative integer")
    return n


def parse_positive_count(name: str, value: Any) -> int:
    n = parse_count(name, value)
    if n < 1:
        raise _bad(name, value, "an integer >= 1")
    return n


def parse_fraction(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise _bad(name, value, "a fraction between 0 and 1", TypeError)
    try:
        f = float(value)
    except ValueError:
        raise _bad(name, value, "a fraction between 0 and 1") from None
    if not 0 <= f <= 1:
        raise _bad(name, value, "a fraction between 0 and 1")
    return f


def choice(*allowed: str) -> Callable[[str, Any], str]:
    def parse(name: str, value: Any) -> str:
        if value not in allowed:
            raise _bad(name, value, "one of " + ", ".join(map(repr, allowed)))
        return str(value)

    return parse


def dotted_names(example: str) -> Callable[[str, Any], tuple[str, ...]]:
    def parse(name: str, value: Any) -> tuple[str, ...]:
        value = [value] if isinstance(value, str) else value
        if not isinstance(value, (list, tuple)) or not all(
            isinstance(v, str) and v and all(p.isidentifier() for p in v.split(".")) for v in value
        ):
            raise _bad(name, value, f"a list of dotted names like {example!r}")
        return tuple(value)

    return parse


@dataclass(frozen=True)
class Threshold:
    """A byte count, or a fraction of a device's memory, resolved per device."""

    nbytes: int | None = None
    fraction: float | None = None

    def resolve(self, device_total: int) -> int:
        if self.nbytes is not None:
            return self.nbytes
        assert self.fraction is not None
        return int(self.fraction * device_total)

    def __str__(self) -> str:
        return f"{self.nbytes} bytes" if self.nbytes is not None else f"{self.fraction:.0%}"


def parse_threshold(name: str, value: Any) -> Threshold:
    """Bytes (``"1GiB"``, ``2**30``) or a fraction of device memory (``0.1``)."""
    expected = "bytes like '1GiB' or a fraction of device memory like 0.1"
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise _bad(name, value, expected, TypeError)
    if isinstance(value, float) or (isinstance(value, str) and _is_float(value)):
        f = float(value)
        if 0 < f < 1:
            return Threshold(fraction=f)
        if math.isfinite(f) and f >= 1 and f == int(f):
            return Threshold(nbytes=int(f))
        raise _bad(name, value, expected)
    n = _nbytes(name, value, expected)
    if n == 0:
        raise _bad(name, value, expected)
    return Threshold(nbytes=n)


def parse_size(name: str, value: Any) -> int:
    """Bytes, zero or more (``"64MiB"``, ``0``)."""
    expected = "bytes like '64MiB', or 0"
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise _bad(name, value, expected, TypeError)
    return _nbytes(name, value, expected)


def _nbytes(name: str, value: int | str, expected: str) -> int:
    """Bytes from an int or a string like ``"64MiB"``, 0 up to 2**63; ValueError naming
    the value otherwise."""
    if isinstance(value, str) and not any(c.isdigit() for c in value):
        raise _bad(name, value, expected)  # dask reads "" or "GiB" as 1 of the unit
    try:
        n = parse_bytes(value) if isinstance(value, str) else int(value)
    except (ValueError, TypeError, IndexError, OverflowError):
        raise _bad(name, value, expected) from None
    if n < 0 or n >= 2**63:
        raise _bad(name, value, expected)
    return int(n)


def _is_float(s: str) -> bool:
    try:
        float(s)
    except ValueError:
        return False
    return "." in s


PLACEMENT_OPTIONS: tuple[Option, ...] = (
    Option("fallback_timeout", "accelsched.placement.fallback-timeout", parse_optional_duration),
    Option("fallback_interval", "accelsched.placement.fallback-interval", parse_interval),
    Option("share_gpus", "accelsched.placement.share-gpus", parse_bool),
    Option("max_restarts", "accelsched.placement.max-restarts", parse_count),
    Option("restart_window", "accelsched.placement.restart-window", parse_positive_duration),
    Option(
        "max_concurrent_restarts",
        "accelsched.placement.max-concurrent-restarts",
        parse_positive_count,
    ),
)

GUARD_OPTIONS: tuple[Option, ...] = (
    Option("advertise_undeclared", "accelsched.guard.advertise-undeclared", parse_bool),
    Option(
        "unrequested_gpu", "accelsched.guard.unrequested-gpu", choice("report", "fail", "ignore")
    ),
    Option("free_pools_every", "accelsched.guard.free-pools-every", parse_count),
    Option("free_pools_above", "accelsched.guard.free-pools-above", parse_fraction),
    Option("free_pools_min", "accelsched.guard.free-pools-min", parse_size),
    Option("check_interval", "accelsched.guard.check-interval", parse_interval),
    Option("leak_threshold", "accelsched.guard.leak-threshold", parse_threshold),
    Option("leak_confirmations", "accelsched.guard.leak-confirmations", parse_positive_count),
    Option("restart_on_leak", "accelsched.guard.restart-on-leak", parse_bool),
    Option("recover_gpus", "accelsched.guard.recover-gpus", parse_bool),
    Option("oom_exceptions", "accelsched.guard.oom-exceptions", dotted_names("mylib.OutOfMemory")),
    Option("fast_restart", "accelsched.guard.fast-restart", parse_bool),
    Option("preimport", "accelsched.guard.preimport", dotted_names("dask.dataframe")),
)
