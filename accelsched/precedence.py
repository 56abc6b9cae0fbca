"""Which value of an option wins when it is set in two places, said in the log.

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
worker applies (2) as the guard is set up there (:func:`on_this_worker`) and logs the
values in effect. A ``register()`` call against plugins already running does not replace
them: an explicit option that differs from what they run with is an error
(:func:`conflicts`), and the client's own config that differs is only logged.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from accelsched.config import BUILTIN, GUARD_OPTIONS, Option, config_value

__all__ = [
    "InEffect",
    "on_this_worker",
    "guard_options_here",
    "set_here",
    "conflicts",
    "worker_preload_options",
]

logger = logging.getLogger(__name__)

#: worker -> the guard options its own ``--preload accelsched`` was given (parsed).
worker_preload_options: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()


def set_here(opt: Option) -> tuple[bool, Any]:
    """(whether this process's dask config sets ``opt`` to a value other than its
    built-in default, that value parsed). A bad value raises, naming the option."""
    value = opt.parse(opt.name, config_value(opt.key))
    return value != opt.parse(opt.name, BUILTIN[opt.key]), value


@dataclass
class InEffect:
    """A guard's options on one worker and where those not handed to it came from."""

    options: dict[str, Any]
    sources: dict[str, str] = field(default_factory=dict)  # name -> where it came from
    overruled: dict[str, tuple[Any, str]] = field(default_factory=dict)  # name -> (value, where)

    def describe(self) -> str:
        """One log line's worth: every option, those set on the worker marked."""
        return ", ".join(
            f"{k}={v}" + (f" ({self.sources[k]})" if k in self.sources else "")
            for k, v in self.options.items()
        )


def on_this_worker(
    handed: Mapping[str, Any], explicit: Collection[str], preload: Mapping[str, Any]
) -> InEffect:
    """The guard options in effect on this worker: ``handed`` (as built, ``explicit``
    the names given explicitly there), with this worker's ``preload`` arguments and own
    dask config applied where no explicit option says otherwise."""
    out = InEffect(dict(handed))
    for opt in GUARD_OPTIONS:
        name = opt.name
        if name in preload:
            value, source = preload[name], "this worker's --preload accelsched"
        else:
            own, value = set_here(opt)
            if not own:
                continue
            source = f"this worker's dask config {opt.key}"
        if value == handed[name]:
            continue
        if name in explicit:
            out.overruled[name] = (value, source)
        else:
            out.options[name] = value
            out.sources[name] = source
    return out


def guard_options_here(
    handed: Mapping[str, Any], explicit: Collection[str], worker: Any
) -> dict[str, Any]:
    """:func:`on_this_worker` for ``worker`` (in its process), logged: a warning naming
    the worker's own settings taken and each one an explicit option overrules (shown by
    default), and every value in effect (at INFO, ``DASK_LOGGING__ACCELSCHED=info``)."""
    here = on_this_worker(handed, explicit, worker_preload_options.get(worker, {}))
    for name, (value, source) in here.overruled.items():
        logger.warning(
            "accelsched: %s=%s from %s is not used: the GuardPlugin was given %s=%s "
            "explicitly (register() or the scheduler's --preload accelsched), which wins",
            name,
            value,
            source,
            name,
            handed[name],
        )
    if here.sources:  # said by default: this worker's guard differs from the cluster's
        logger.warning(
            "accelsched: this worker's own settings apply to its guard: %s",
            ", ".join(f"{k}={here.options[k]} ({src})" for k, src in here.sources.items()),
        )
    logger.info("accelsched: guard options in effect on this worker: %s", here.describe())
    return here.options


def conflicts(
    owner: str,
    options: tuple[Option, ...],
    given: Mapping[str, Any],
    built: Mapping[str, Any],
    running: Mapping[str, Any],
) -> tuple[list[str], list[str]]:
    """(errors, notes) for a plugin built with ``built`` (``given`` explicitly) where
    one already ``running`` is kept: an explicit option that differs is an error; one
    this process's config sets and that differs is a note for the log."""
    errors, notes = [], []
    for opt in options:
        name = opt.name
        if built[name] == running.get(name, built[name]):
            continue
        if name in given:
            errors.append(f"{name}={given[name]!r} (the running {owner} has {running[name]})")
        elif set_here(opt)[0]:
            notes.append(f"{name}={built[name]} (the running {owner} keeps {running[name]})")
    return errors, notes
