"""Options: dask config defaults, environment overrides, validated constructor arguments,
and which value wins when an option is set in two places.

Every option of :class:`~accelsched.PlacementPlugin` and :class:`~accelsched.GuardPlugin`
has a dask config key under ``accelsched.`` (so ``DASK_ACCELSCHED__...`` environment
variables work); a constructor argument wins over config. Values are validated when a
plugin is constructed, on the client, so a typo fails there with the option and the value
named, not later inside a scheduler or a worker.

An option's value comes, first found wins, from:

1. an explicit option: an argument of :func:`accelsched.register`, of a plugin's
   constructor, or of the scheduler's ``--preload accelsched``;
2. on one worker, for the guard: that worker's own ``--preload accelsched`` arguments,
   then that worker's own dask config (YAML or ``DASK_ACCELSCHED__GUARD__...`` on its
   host), where it sets a value other than the built-in default;
3. the dask config of the process that built the plugin (the client that called
   ``register``, or the scheduler with ``--preload accelsched``);
4. the built-in default.

A guard is built once (on the client or the scheduler) and handed to every worker; each
worker applies (2) as the guard is set up there (:func:`guard_options_here`) and logs
the values in effect. A ``register()`` call against plugins already running does not
replace them: an explicit option that differs from what they run with is an error
(:func:`check_running`), and the client's own config that differs is only logged.

Logging: accelsched's loggers, set up the way distributed sets up its own.

Every module logs under ``accelsched`` (``accelsched.scheduler.fallback``, ...). distributed,
when imported, reads dask's ``logging`` config: in its short form
(``logging: {distributed: info, accelsched: debug}``, or ``DASK_LOGGING__ACCELSCHED=debug``)
it gives each logger named there its level and a stderr handler in
``distributed.admin.log-format``, and ``distributed`` itself INFO when the config does not
name it. :func:`initialize_logging` gives ``accelsched`` that same default: INFO, and a
stderr handler in distributed's format, so a scheduler's or a worker's log shows what
accelsched does (the options in effect, every event) beside distributed's lines, each once.

It steps aside where the operator said more:

- the config names ``accelsched``: distributed sets it up, with that level;
- the config is the full ``logging.config`` form (``version: 1``) or a file
  (``logging-file-config``): that configuration owns every logger, accelsched's too;
- a level was set on ``accelsched`` already (by the application): it is kept;
- the root logger has a handler (``logging.basicConfig``, pytest's capture): accelsched's
  records go there alone (the handler here passes nothing while the root has one), so a
  line is never printed twice and ``caplog`` sees them.
"""

from __future__ import annotations

import builtins
import contextlib
import difflib
import functools
import logging
import math
import numbers
import os
import re
import string
import sys
import weakref
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import dask.config
import yaml
from dask.utils import parse_bytes, parse_timedelta

from accelsched.protocol import INT_LIMIT

__all__ = [
    "Option",
    "resolve_options",
    "unknown_config",
    "warn_unknown_config",
    "config_value",
    "Threshold",
    "PLACEMENT_OPTIONS",
    "GUARD_OPTIONS",
    "ADAPT_OPTIONS",
    "on_this_worker",
    "guard_options_here",
    "check_running",
    "worker_preload_options",
    "LOGGER",
    "initialize_logging",
]

logger = logging.getLogger(__name__)

#: The built-in default of every key, kept apart from dask's config: a harness that
#: restores a config snapshot taken before accelsched was imported (distributed's own test
#: clusters do) removes the keys, and a key that is absent means its built-in default.
with open(os.path.join(os.path.dirname(__file__), "accelsched.yaml")) as _f:
    BUILTIN: dict[str, Any] = yaml.safe_load(_f)
dask.config.update_defaults(BUILTIN)


def config_value(key: str, builtin: bool = False) -> Any:
    """``key``'s value in dask config, or its built-in default where the key is absent
    (only a present, bad value is an error, raised by the option's parser); ``builtin``:
    the built-in default itself."""
    default = dask.config.get(key, config=BUILTIN)
    return default if builtin else dask.config.get(key, default)


@dataclass(frozen=True)
class Option:
    """One public option: its argument name, its config key and how to validate it."""

    name: str
    key: str
    parse: Callable[[str, Any], Any]

    @property
    def flag(self) -> str:
        """Its command-line spelling (``--fallback-timeout``)."""
        return "--" + self.name.replace("_", "-")

    def set_here(self) -> tuple[bool, Any]:
        """(whether this process's dask config sets it to a value other than its
        built-in default, that value parsed). A bad value raises, naming the option and
        its key."""
        value = parse_option(self, {})
        return value != self.parse(self.name, config_value(self.key, builtin=True)), value


def refuse_unknown(given: Collection[str], options: tuple[Option, ...], owner: str) -> None:
    """``TypeError`` naming the options in ``given`` that are none of ``options``."""
    known = {o.name for o in options}
    if unknown := sorted(set(given) - known):
        raise TypeError(
            f"{owner} got unknown option(s) {', '.join(map(repr, unknown))}; "
            f"valid options: {', '.join(sorted(known))}"
        )


def only(options: tuple[Option, ...], given: Mapping[str, Any]) -> dict[str, Any]:
    """The items of ``given`` that are ``options``."""
    return {o.name: given[o.name] for o in options if o.name in given}


def unknown_config(config: Mapping[str, Any] | None = None) -> list[str]:
    """What the ``accelsched`` section of dask ``config`` (this process's) sets that no
    key of accelsched reads: a misspelled key, or a value where a group of keys belongs
    (``DASK_ACCELSCHED__PLACEMENT=5``). Each is a line naming it, and the key it may have
    meant. dask spells a key with ``-`` or ``_`` alike; so does this."""
    section = (dask.config.config if config is None else config).get("accelsched", {})
    found: list[str] = []

    def walk(given: Any, known: Mapping[str, Any], path: str) -> None:
        if given is None:  # a YAML group with every key commented out: nothing set
            return
        if not isinstance(given, Mapping):
            found.append(
                f"{path}={_shown(given)} (expected keys under it: "
                f"{', '.join(f'{path}.{k}' for k in known)})"
            )
            return
        spelled = {k.replace("_", "-"): k for k in known}
        for key, value in given.items():
            name = spelled.get(str(key).replace("_", "-"))
            if name is None:
                near = difflib.get_close_matches(str(key).replace("_", "-"), spelled, n=1)
                found.append(
                    f"{path}.{_shown(key, name=True)}"
                    + (f" (did you mean {path}.{spelled[near[0]]}?)" if near else "")
                )
            elif isinstance(known[name], Mapping):
                walk(value, known[name], f"{path}.{name}")

    walk(section, BUILTIN["accelsched"], "accelsched")
    return found


def _shown(value: Any, name: bool = False) -> str:
    """``value`` on one short line: a plain key ``name`` as it is, anything else as its
    repr, cut at 80 characters (a config file could hold a newline, or a megabyte)."""
    if name and isinstance(value, str) and re.fullmatch(r"[\w.-]{1,80}", value, re.ASCII):
        return value
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


#: What :func:`warn_unknown_config` said already in this process.
_said_unknown: set[str] = set()
#: The most unknown settings listed one by one at a time; the rest are counted.
MAX_UNKNOWN_SAID = 10


def warn_unknown_config() -> None:
    """Log, once per process, each ``accelsched`` config setting no key reads: a typo in
    a YAML file or a ``DASK_ACCELSCHED__...`` variable would otherwise leave the default
    in effect without a word (dask itself reads any key it is asked for, and none other).
    Read in the YAML files and the environment as dask collects them, too: a value where a
    group of keys belongs (``DASK_ACCELSCHED__ADAPT=5``) is replaced by the group's
    defaults in the config in effect."""
    new = dict.fromkeys(  # in order, once
        line
        for line in unknown_config(dask.config.collect()) + unknown_config()
        if line not in _said_unknown
    )
    _said_unknown.update(new)
    for line in list(new)[:MAX_UNKNOWN_SAID]:
        logger.warning("accelsched: dask config %s is not an accelsched option: ignored", line)
    if len(new) > MAX_UNKNOWN_SAID:
        logger.warning(
            "accelsched: dask config has %d more settings under accelsched that no option "
            "reads, ignored (not listed)",
            len(new) - MAX_UNKNOWN_SAID,
        )


def resolve_options(
    options: tuple[Option, ...], given: Mapping[str, Any], owner: str
) -> dict[str, Any]:
    """Validated values for ``options``: arguments win over dask config (whose keys no
    option reads are logged, see :func:`warn_unknown_config`)."""
    refuse_unknown(given, options, owner)
    warn_unknown_config()
    return {o.name: parse_option(o, given) for o in options}


def parse_option(opt: Option, given: Mapping[str, Any]) -> Any:
    """``opt``'s value: the one ``given``, else dask config's; an error in a config value
    says where it came from (``dask config accelsched.guard.leak-threshold: invalid
    ...``): nobody typed it where the error shows."""
    if opt.name in given:
        return opt.parse(opt.name, given[opt.name])
    try:
        return opt.parse(opt.name, config_value(opt.key))
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"dask config {opt.key}: {exc}") from None


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
    if value is True or not isinstance(value, (numbers.Real, str)):
        raise _bad(name, value, expected, TypeError)
    if isinstance(value, numbers.Real) and not isinstance(value, (int, float)):
        value = float(value)  # numpy's scalars: a number as any other
    text = value.strip().removeprefix("+") if isinstance(value, str) else None
    if text is not None and not _DURATION.match(text):  # "", "s", ".": no number at all
        raise _bad(name, value, expected)
    try:
        # dask reads ".5s" as "1.5s", and knows "m" and "minutes" but not "min"/"mins"
        seconds = float(
            parse_timedelta(
                value
                if text is None
                else re.sub(r"(?<=[\d\s.])mins?$", "minutes", re.sub(r"^(-?)\.", r"\g<1>0.", text)),
                default="seconds",
            )
        )
    except (ValueError, KeyError, TypeError, IndexError, OverflowError):
        raise _bad(name, value, expected) from None
    if not math.isfinite(seconds) or seconds < 0:
        raise _bad(name, value, "a finite, non-negative duration")
    return seconds


def parse_interval(name: str, value: Any, least: float = MIN_INTERVAL) -> float:
    """A positive duration; a periodic check's interval: at least ``least``."""
    seconds = parse_optional_duration(name, value)
    if seconds is None or seconds <= 0:
        raise _bad(name, value, "a positive duration like '250ms' or '1s'")
    if seconds < least:
        raise _bad(name, value, f"an interval of at least {least * 1000:g}ms")
    return seconds


def parse_duration(name: str, value: Any) -> float:
    """A duration that may be 0 (at once) but not absent: None is refused, not read as
    never."""
    try:
        seconds = parse_optional_duration(name, value)
    except (TypeError, ValueError) as exc:
        raise _bad(name, value, _DURATION_OR_0, type(exc)) from None
    if seconds is None:
        raise _bad(name, value, _DURATION_OR_0, TypeError)
    return seconds


_DURATION_OR_0 = "a duration >= 0, like '0s', '500ms' or '60s'"


def parse_bool(name: str, value: Any) -> bool:
    found = {"true": True, "false": False}.get(value.lower()) if isinstance(value, str) else value
    if isinstance(found, bool):
        return found
    raise _bad(name, value, "True or False", TypeError)


def number(kind: type, expected: str, ok: Callable[[Any], bool]) -> Callable[[str, Any], Any]:
    """A parser of a ``kind`` number where ``ok`` (a bool is no number; a string is
    read as one); an integer under :data:`~accelsched.protocol.INT_LIMIT`."""

    # numpy's scalars too; a count takes no float (read, it would be cut)
    accepted = (numbers.Integral if kind is int else numbers.Real, str)

    def parse(name: str, value: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, accepted):
            raise _bad(name, value, expected, TypeError)
        with contextlib.suppress(ValueError, OverflowError):  # (float(10**400) overflows)
            if ok(n := kind(value)) and (kind is not int or n < INT_LIMIT):
                return n
        raise _bad(name, value, expected)

    return parse


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


def exception_names(name: str, value: Any) -> tuple[str, ...]:
    """Dotted exception names as they are matched (``module.QualName``): a bare name is
    a builtin's (``MemoryError`` is ``builtins.MemoryError``), else it could never match:
    a bare name no builtin exception has is refused (``OutOfMemoryError`` would never
    match CuPy's, and no ``dual`` step would run its CPU form on it)."""
    names = dotted_names("cupy.cuda.memory.OutOfMemoryError")(name, value)
    for n in names:
        found = getattr(builtins, n, None) if "." not in n else BaseException
        if not (isinstance(found, type) and issubclass(found, BaseException)):
            raise _bad(
                name,
                value,
                f"dotted exception names like 'cupy.cuda.memory.OutOfMemoryError' ({n!r} is "
                "no builtin exception: a bare name is a builtin's)",
            )
    return tuple(n if "." in n else f"builtins.{n}" for n in names)


@dataclass(frozen=True)
class Threshold:
    """A byte count, or a fraction of a device's memory, resolved per device."""

    nbytes: int | None = None
    fraction: float | None = None

    def resolve(self, device_total: int) -> int:
        return self.nbytes if self.nbytes is not None else int((self.fraction or 0) * device_total)

    def __str__(self) -> str:
        return f"{self.nbytes} bytes" if self.nbytes is not None else f"{self.fraction:.0%}"


def parse_threshold(name: str, value: Any) -> Threshold:
    """Bytes (``"1GiB"``, ``2**30``) or a fraction of device memory (``0.1``)."""
    expected = "bytes like '1GiB' or a fraction of device memory like 0.1"
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, str)):
        raise _bad(name, value, expected, TypeError)
    try:  # a float, or a string of one with a point ("1.5GiB" is bytes)
        f = float(value) if isinstance(value, float) or "." in str(value) else None
    except ValueError:  # "1.5GiB"
        f = None
    if f is None:  # bytes, or no number (parse_size says which, as here)
        if (n := parse_size(name, value, expected)) == 0:
            raise _bad(name, value, expected)
        return Threshold(nbytes=n)
    if 0 < f < 1:
        return Threshold(fraction=f)
    if math.isfinite(f) and 1 <= f < INT_LIMIT and f == int(f):
        return Threshold(nbytes=int(f))
    raise _bad(name, value, expected)


def size_bytes(text: str) -> int | None:
    """The whole bytes a size says (``"24GiB"``, ``"1.5GiB"``, ``"8.2GB"``, ``"512"``), or
    None where it says none: no number (``""``, ``"GiB"``: dask reads one of the unit), a
    fraction of a byte (``"1.5"``, ``"1.5e0"``, ``"1.5B"``: dask drops the fraction), or no
    size at all. dask says whether it is a size and what its unit is worth; the number
    before the unit is read exactly (dask's floats make ``"8.2GB"`` 8199999999 bytes)."""
    stripped = text.strip()
    number = stripped.rstrip(string.ascii_letters)  # dask's split: the unit is the letters
    if not any(c.isdigit() for c in number):
        return None
    unit = stripped[len(number) :]
    try:
        parse_bytes(stripped)  # a size dask reads, in a unit it knows
        exact = Fraction(number.strip()) * (parse_bytes("1" + unit) if unit else 1)
    except (ValueError, TypeError, IndexError, OverflowError, ZeroDivisionError):
        return None
    return int(exact) if exact.denominator == 1 else None


def parse_size(name: str, value: Any, expected: str = "bytes like '64MiB', or 0") -> int:
    """Bytes, zero or more (``"64MiB"``, ``0``, a numpy integer, or ``1e6``: dask config
    reads an environment value so), under :data:`~accelsched.protocol.INT_LIMIT`."""
    whole = isinstance(value, float) and math.isfinite(value) and value == int(value)
    if isinstance(value, bool) or not (whole or isinstance(value, (numbers.Integral, str))):
        raise _bad(name, value, expected, TypeError)
    n = size_bytes(value) if isinstance(value, str) else int(value)
    if n is None or n < 0 or n >= INT_LIMIT:
        raise _bad(name, value, expected)
    return n


COUNT = number(int, f"a non-negative integer under {INT_LIMIT}", lambda n: n >= 0)
POSITIVE_COUNT = number(int, f"an integer >= 1 and under {INT_LIMIT}", lambda n: n >= 1)
FRACTION = number(float, "a fraction between 0 and 1", lambda f: 0 <= f <= 1)

PLACEMENT_OPTIONS: tuple[Option, ...] = (
    Option("fallback_timeout", "accelsched.placement.fallback-timeout", parse_optional_duration),
    Option("fallback_interval", "accelsched.placement.fallback-interval", parse_interval),
    Option("share_gpus", "accelsched.placement.share-gpus", parse_bool),
    Option("max_restarts", "accelsched.placement.max-restarts", COUNT),
    Option(
        "restart_window",
        "accelsched.placement.restart-window",
        functools.partial(parse_interval, least=0),
    ),
    Option(
        "max_concurrent_restarts",
        "accelsched.placement.max-concurrent-restarts",
        POSITIVE_COUNT,
    ),
)

GUARD_OPTIONS: tuple[Option, ...] = (
    Option("advertise_undeclared", "accelsched.guard.advertise-undeclared", parse_bool),
    Option(
        "unrequested_gpu", "accelsched.guard.unrequested-gpu", choice("report", "fail", "ignore")
    ),
    Option("free_pools_every", "accelsched.guard.free-pools-every", COUNT),
    Option("free_pools_above", "accelsched.guard.free-pools-above", FRACTION),
    Option("free_pools_min", "accelsched.guard.free-pools-min", parse_size),
    Option("check_interval", "accelsched.guard.check-interval", parse_interval),
    Option("leak_threshold", "accelsched.guard.leak-threshold", parse_threshold),
    Option("leak_confirmations", "accelsched.guard.leak-confirmations", POSITIVE_COUNT),
    Option("restart_on_leak", "accelsched.guard.restart-on-leak", parse_bool),
    Option("recover_gpus", "accelsched.guard.recover-gpus", parse_bool),
    Option("oom_exceptions", "accelsched.guard.oom-exceptions", exception_names),
    Option("enforce_memory", "accelsched.guard.enforce-memory", parse_bool),
    Option("fast_restart", "accelsched.guard.fast-restart", parse_bool),
    Option("preimport", "accelsched.guard.preimport", dotted_names("dask.dataframe")),
)

#: :func:`accelsched.adapt`'s options: distributed's ``Adaptive`` ones (``interval``,
#: ``wait_count``, ``target_duration``, same meaning) and the pools' own.
ADAPT_OPTIONS: tuple[Option, ...] = (
    Option("interval", "accelsched.adapt.interval", functools.partial(parse_interval, least=0.05)),
    Option("wait_count", "accelsched.adapt.wait-count", POSITIVE_COUNT),
    Option("target_duration", "accelsched.adapt.target-duration", parse_interval),
    Option("idle_after", "accelsched.adapt.idle-after", parse_duration),
    Option("start_timeout", "accelsched.adapt.start-timeout", parse_duration),
)


# --- which value wins: a worker's own settings, a register() against running plugins -----

#: Guard options a worker's own settings do not change: ``fast_restart`` says how nannies
#: start worker processes (:class:`accelsched.FastRestart`), which is decided where the
#: plugins are installed (``register()``, the scheduler's ``--preload accelsched``).
NOT_PER_WORKER = frozenset({"fast_restart"})

#: worker -> the guard options its own ``--preload accelsched`` was given (parsed).
worker_preload_options: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()


def on_this_worker(
    handed: Mapping[str, Any], explicit: Collection[str], preload: Mapping[str, Any]
) -> tuple[dict[str, Any], dict[str, str], dict[str, tuple[Any, str]]]:
    """The guard options in effect on this worker: ``handed`` (as built, ``explicit``
    the names given explicitly there), with this worker's ``preload`` arguments and own
    dask config applied where no explicit option says otherwise. With them, where each
    one not as handed came from (name -> where), and this worker's own settings that an
    explicit option overrules, or that are not a worker's to set (:data:`NOT_PER_WORKER`)
    (name -> (value, where))."""
    options, sources, overruled = dict(handed), {}, {}
    for opt in GUARD_OPTIONS:
        mine = opt.name in preload  # (this worker's config is not read then)
        own, value = (True, preload[opt.name]) if mine else opt.set_here()
        source = (
            "this worker's --preload accelsched" if mine else f"this worker's dask config {opt.key}"
        )
        if not own or value == handed[opt.name]:
            continue
        if opt.name in explicit or opt.name in NOT_PER_WORKER:
            overruled[opt.name] = (value, source)
        else:
            options[opt.name] = value
            sources[opt.name] = source
    return options, sources, overruled


def guard_options_here(
    handed: Mapping[str, Any], explicit: Collection[str], worker: Any
) -> dict[str, Any]:
    """:func:`on_this_worker` for ``worker`` (in its process), logged: a warning naming
    the worker's own settings taken and each one an explicit option overrules (shown by
    default), and every value in effect (at INFO, also shown by default)."""
    warn_unknown_config()  # this worker's own config: keys no option reads
    options, sources, overruled = on_this_worker(
        handed, explicit, worker_preload_options.get(worker, {})
    )
    for name, (value, source) in overruled.items():
        if name in NOT_PER_WORKER:
            logger.warning(
                "accelsched: %s=%s from %s is not used: it says how nannies start workers, "
                "which register() or the scheduler's --preload accelsched decides (%s=%s)",
                name,
                value,
                source,
                name,
                handed[name],
            )
            continue
        logger.warning(
            "accelsched: %s=%s from %s is not used: the GuardPlugin was given %s=%s "
            "explicitly (register() or the scheduler's --preload accelsched), which wins",
            name,
            value,
            source,
            name,
            handed[name],
        )
    if sources:  # said by default: this worker's guard differs from the cluster's
        logger.warning(
            "accelsched: this worker's own settings apply to its guard: %s",
            ", ".join(f"{k}={options[k]} ({src})" for k, src in sources.items()),
        )
    logger.info(
        "accelsched: guard options in effect on this worker: %s",
        ", ".join(
            f"{k}={v}" + (f" ({sources[k]})" if k in sources else "") for k, v in options.items()
        ),
    )
    return options


def check_running(
    given: Mapping[str, Any],
    built: Mapping[str, Mapping[str, Any]],
    running: Mapping[str, Mapping[str, Any] | None],
) -> None:
    """``register()`` keeps the plugins already ``running`` (``"placement"``, ``"guard"``:
    their options, None where none runs): an option ``given`` explicitly that differs from
    what they run with is a ``ValueError``; one this client's config sets that differs is
    logged, as not used."""
    errors, notes = [], []
    for side, owner, options in (
        ("placement", "PlacementPlugin", PLACEMENT_OPTIONS),
        ("guard", "GuardPlugin", GUARD_OPTIONS),
    ):
        now = running[side] or {}  # none running: nothing differs
        for opt in options:
            name, value = opt.name, built[side][opt.name]
            if name not in now or value == now[name]:
                continue
            if name in given:
                errors.append(f"{name}={given[name]!r} (the running {owner} has {now[name]})")
            elif opt.set_here()[0]:
                notes.append(f"{name}={value} (the running {owner} keeps {now[name]})")
    if errors:
        raise ValueError(
            f"register() was given {'; '.join(errors)}: accelsched's plugins already run "
            "on this scheduler (its --preload accelsched or an earlier register()) and are "
            "kept. Unregister them first to change options (docs/placement.md), or set the "
            "option where the scheduler is started"
        )
    for note in notes:
        logger.warning("accelsched: this client's dask config %s: not used", note)


# --- accelsched's loggers ----------------------------------------------------------------

#: The parent of every accelsched logger.
LOGGER = "accelsched"
#: distributed's ``distributed.admin.log-format`` default, for a process that has not
#: imported distributed (its config defaults are loaded by its import).
_FORMAT = "%(asctime)s - %(name)s - %(levelname)s - %(message)s"


#: The handler :func:`initialize_logging` adds, once per process (``addHandler`` adds a
#: handler once). Records pass only while the root logger has no handler (its own: it
#: has no parent): once the application configured logging, its handlers print
#: accelsched's records (they propagate).
_HANDLER = logging.StreamHandler(sys.stderr)
_HANDLER.addFilter(lambda record: not logging.getLogger().hasHandlers())
_HANDLER.setFormatter(logging.Formatter(dask.config.get("distributed.admin.log-format", _FORMAT)))


def initialize_logging(config: Mapping[str, Any] | None = None) -> bool:
    """Give the ``accelsched`` logger distributed's defaults (INFO, a stderr handler in
    its format) unless dask's ``logging`` config or the application set it up; True when
    it did. Safe to call again: nothing is added twice."""
    config = dask.config.config if config is None else config
    # where distributed looks for the logging keys: under ``distributed`` first, else at
    # the top (as ``distributed.config._find_logging_config``)
    nested = config.get("distributed", {})
    base = (
        nested
        if isinstance(nested, Mapping) and {"logging", "logging-file-config"} & nested.keys()
        else config
    )
    short = base.get("logging", {})
    if (
        "logging-file-config" in base
        or not isinstance(short, Mapping)
        or "version" in short
        or LOGGER in short
    ):
        return False
    logger = logging.getLogger(LOGGER)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    logger.addHandler(_HANDLER)
    return True
