"""Command line: ``accelsched demo|status|events|simulate|version``, in click as dask's own.

The same group is ``accelsched`` (also ``python -m accelsched``) and ``dask accelsched``:
dask's command finds it through the ``dask_cli`` entry point group, as it finds
distributed's ``dask scheduler`` and ``dask worker``. ``status`` and ``events`` run in
:mod:`accelsched.cli.commands` (a ``--scheduler-file`` too); their exit codes are in
:mod:`accelsched.display.status_table`. ``simulate`` runs in :mod:`accelsched.testing.simulate`.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import Any, NoReturn

import click
import dask

from accelsched import __version__
from accelsched.cli.commands import (
    ReaderGone,
    address_from_file,
    print_events,
    print_status,
    timeout_seconds,
)
from accelsched.display.status_table import EXIT_CODES_HELP
from accelsched.events import ACTIONS

__all__ = ["cli", "main", "print_events", "print_status"]

#: Seconds a connection gets at least after ``--scheduler-file`` waited for its file
#: (one ``--timeout`` covers both).
MIN_CONNECT = 1.0
#: Exit code after Ctrl-C before an answer, and ending ``events --follow`` (128 + SIGINT).
INTERRUPTED = 130

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 88}


@click.group(
    name="accelsched", context_settings=CONTEXT, epilog=f"status and events: {EXIT_CODES_HELP}"
)
@click.version_option(__version__, prog_name="accelsched")
def cli() -> None:
    """GPUs as real, scarce, fallible hardware for Dask's distributed scheduler.

    status and events take the scheduler as dask's own commands do: SCHEDULER (its
    address), --scheduler-file PATH, or dask config scheduler-address
    (DASK_SCHEDULER_ADDRESS)."""


def main(argv: list[str] | None = None) -> int:
    """``accelsched ARGS``: the exit code. A usage error ends the program (exit 2, as
    click's own); every other outcome is returned, for callers in Python."""
    try:
        code = cli.main(argv, prog_name="accelsched", standalone_mode=False)
    except click.UsageError as exc:
        exc.show()
        raise SystemExit(exc.exit_code) from None
    return code if isinstance(code, int) else 0


def _path(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value == "":
        raise click.BadParameter("invalid PATH '': expected a file name")
    return value


def _timeout(ctx: click.Context, param: click.Parameter, value: str) -> float:
    try:
        return timeout_seconds(value)
    except (TypeError, ValueError) as exc:
        raise click.BadParameter(str(exc)) from None


def _interval(ctx: click.Context, param: click.Parameter, value: str | None) -> float | None:
    """``--watch`` SECONDS: a positive number."""
    if value is None:
        return None
    with contextlib.suppress(ValueError):
        if 0 < (seconds := float(value)) < float("inf"):
            return seconds
    raise click.BadParameter(f"invalid SECONDS {value!r}: expected a number > 0")


def _scheduler_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """Where the scheduler is, as dask's own commands take it: the address, the file
    ``dask scheduler --scheduler-file`` writes, or dask config ``scheduler-address``
    (``DASK_SCHEDULER_ADDRESS``); and how long to try to reach it."""
    command = click.option(
        "--timeout",
        default="10s",
        metavar="DURATION",
        callback=_timeout,
        help="How long to try to reach the scheduler, its scheduler file included (default 10s).",
    )(command)
    command = click.option(
        "--scheduler-file",
        metavar="PATH",
        callback=_path,
        help="Read the address from the file dask scheduler --scheduler-file PATH writes "
        "(waiting for it within --timeout), instead of giving SCHEDULER.",
    )(command)
    return click.argument("scheduler", required=False)(command)


def _ask(ctx: click.Context, run: Callable[[str, float], int]) -> NoReturn:
    """``status`` or ``events``: the address (one ``--timeout`` for the scheduler file and
    the connection together), then ``run(address, seconds to connect)``'s exit code."""
    from accelsched.demo.quiet import quiet_logs

    command, params = ctx.command.name, ctx.params
    address, timeout, path = params["scheduler"], params["timeout"], params["scheduler_file"]
    if address is not None and path is not None:
        raise click.UsageError("give a SCHEDULER address or --scheduler-file PATH, not both")
    if address is None and path is None:
        address = dask.config.get("scheduler-address", None)
        if address is None:
            raise click.UsageError(
                "give a SCHEDULER address or --scheduler-file PATH (or set DASK_SCHEDULER_ADDRESS)"
            )
    # distributed's own log lines (a reconnect that failed, ...) would come on top of the
    # one line each error is
    with quiet_logs(logging.CRITICAL):
        try:
            connect = timeout
            if path is not None:
                deadline = time.monotonic() + timeout
                address = address_from_file(path, deadline, str(command))
                connect = max(deadline - time.monotonic(), MIN_CONNECT)
            ctx.exit(address if isinstance(address, int) else run(address, connect))
        except ReaderGone:  # `accelsched status --watch | head`: the reader left
            # nothing more can be written there, not even the flush at exit
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            ctx.exit(0)
        except KeyboardInterrupt:  # Ctrl-C before anything was shown, or ending --follow
            ctx.exit(INTERRUPTED)


@cli.command(
    help="A table per worker: verified GPUs, leases, leak estimate, quarantine, restarts, "
    "fallbacks; the options in effect and the GPU tasks waiting, by why.",
    epilog=EXIT_CODES_HELP,
)
@_scheduler_options
@click.option(
    "--json", "as_json", is_flag=True, help="Print the snapshot as JSON (one object a line)."
)
@click.option(
    "--watch",
    is_flag=False,
    flag_value="2",
    callback=_interval,
    metavar="[SECONDS]",
    help="Redraw every SECONDS (default 2) until Ctrl-C.",
)
@click.pass_context
def status(
    ctx: click.Context, timeout: float, as_json: bool, watch: float | None, **_: Any
) -> NoReturn:
    _ask(
        ctx,
        lambda address, connect: print_status(
            address, sys.stdout, as_json=as_json, watch=watch, timeout=timeout, connect=connect
        ),
    )


@cli.command(help="Print accelsched's events from a running cluster's scheduler.")
@_scheduler_options
@click.option(
    "--action",
    "actions",
    multiple=True,
    type=click.Choice(sorted(ACTIONS)),
    help="Only these actions (repeatable).",
)
@click.option("--json", "as_json", is_flag=True, help="One JSON object a line, as logged.")
@click.option("--follow", is_flag=True, help="Then print new events as they come, until Ctrl-C.")
@click.pass_context
def events(
    ctx: click.Context,
    timeout: float,
    actions: tuple[str, ...],
    as_json: bool,
    follow: bool,
    **_: Any,
) -> NoReturn:
    _ask(
        ctx,
        lambda address, connect: print_events(
            address, list(actions), sys.stdout, timeout, connect, as_json=as_json, follow=follow
        ),
    )


@cli.command()
@click.option(
    "--report",
    metavar="PATH",
    help="Where to write the report: a .html file or a folder (default accelsched-demo.html "
    "in the system's temporary folder; the path is printed).",
)
@click.pass_context
def demo(ctx: click.Context, report: str | None) -> NoReturn:
    """Run a local cluster (real GPUs when NVML sees any, else simulated ones) through
    placement, a leak and a fallback, and write an HTML report."""
    from accelsched.demo import main as demo_main

    ctx.exit(demo_main(report))


class _OwnParser(click.Command):
    """A command that parses its arguments itself (``simulate`` keeps its argparse
    parser: ``--`` and everything after it reach it untouched)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        ctx.args = list(args)
        return []


@cli.command(
    cls=_OwnParser,
    add_help_option=False,
    short_help="Run a command (dask worker, dask scheduler, python script.py) on simulated "
    "GPUs, as accelsched.testing.fake_gpus shows them.",
)
@click.pass_context
def simulate(ctx: click.Context) -> NoReturn:
    # a testing tool: its module (and the simulated devices) load only here
    from accelsched.testing.simulate import simulate_arguments, simulate_main

    parser = argparse.ArgumentParser(
        prog=ctx.command_path,
        usage=f"{ctx.command_path} [-h] --gpus N [options] -- COMMAND [ARG ...]",
        description="Run COMMAND where NVML (pynvml, distributed, dask-cuda, accelsched) "
        "sees N simulated GPUs; exit with its exit code. Signals sent to this process "
        "reach COMMAND; the simulation is removed when it ends.",
    )
    simulate_arguments(parser)
    ctx.exit(simulate_main(parser, parser.parse_args(ctx.args)))


@cli.command()
def version() -> None:
    """Print the version."""
    click.echo(__version__)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
