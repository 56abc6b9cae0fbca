"""How a ``--preload accelsched`` failure shows: one line, and a non-zero exit.

distributed logs a failing preload and runs the server on, and its commands exit with 0
once their servers close. So a bad argument parsed on the command line is one click
error line (exit 2) without the usage text, and a failure once a server runs stops it
and makes the command in that process exit with 1, as supervisors (systemd, Kubernetes,
Slurm) expect of a failure.
"""

from __future__ import annotations

from typing import Any

import click

from accelsched.config import PLACEMENT_OPTIONS, Option

__all__ = [
    "PreloadError",
    "BadPreloadValue",
    "flag",
    "exit_nonzero_after_the_command",
    "refuse_placement_options",
    "parsing_for_a_worker_command",
]


class PreloadError(click.UsageError):
    """A bad preload argument or config value: click prints ``Error: <message>``, one
    line without the usage text (which would be the preload's, that nobody typed), and
    the command exits with 2, click's code for a usage error."""

    def show(self, file: Any = None) -> None:
        click.ClickException.show(self, file)


class BadPreloadValue(PreloadError, click.BadParameter):
    """A bad value (:class:`click.BadParameter`), shown as :class:`PreloadError`."""


def flag(opt: Option) -> str:
    return "--" + opt.name.replace("_", "-")


def exit_nonzero_after_the_command() -> None:
    """Make the command running in this process (``dask scheduler``, ``dask worker``
    with ``--no-nanny``, or, run there, a worker's nanny) exit with 1 once it has closed
    its servers, through click's own ``Exit``.

    distributed's commands run the server inside their click callback, so the command's
    context is current here; it closes when the callback returns, after the server has
    closed cleanly. In a process no such command runs (a ``LocalCluster``, a test) nothing
    changes: the server stops, the process goes on.
    """
    ctx = click.get_current_context(silent=True)
    if ctx is None or _dask_command() is None:
        return

    def fail() -> None:
        raise click.exceptions.Exit(1)

    ctx.find_root().call_on_close(fail)


def refuse_placement_options(placement_options: dict[str, Any]) -> None:
    """A worker given the scheduler's options: an error naming each with its value."""
    if not placement_options:
        return
    given = [
        f"{flag(o)} {placement_options[o.name]!r}"
        for o in PLACEMENT_OPTIONS
        if o.name in placement_options
    ]
    verb = "applies" if len(given) == 1 else "apply"
    raise PreloadError(
        f"{', '.join(given)} {verb} to the scheduler (placement), not to a worker: give "
        f"{'it' if len(given) == 1 else 'them'} to `dask scheduler --preload accelsched`"
    )


def _dask_command() -> str | None:
    """The module of the distributed/dask-cuda command running in this process's
    current click context (``distributed.cli.dask_worker``, ...), or None."""
    ctx = click.get_current_context(silent=True)
    callback = getattr(getattr(ctx, "command", None), "callback", None)
    module = getattr(callback, "__module__", None) or ""
    return module if module.startswith(("distributed.cli.", "dask_cuda.cli")) else None


def parsing_for_a_worker_command() -> bool:
    """Whether the arguments are being checked by ``dask worker``/``dask cuda worker``
    as it parses its command line (distributed checks a preload's arguments then, in the
    command's own process, before any worker starts)."""
    module = _dask_command()
    return module is not None and (module.endswith("dask_worker") or "dask_cuda" in module)
