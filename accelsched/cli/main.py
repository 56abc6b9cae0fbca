"""Command line: ``accelsched demo|status|events|simulate|version`` (also
``python -m accelsched``).

``status`` and ``events`` run in :mod:`accelsched.cli.commands` (a ``--scheduler-file`` is
read by :mod:`accelsched.cli.scheduler_file`); their exit codes are in
:mod:`accelsched.observe.status_table`.
``simulate`` runs in :mod:`accelsched.testing.simulate`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from accelsched.cli.commands import ReaderGone, print_events, print_status
from accelsched.cli.scheduler_file import address_from_file
from accelsched.events import ACTIONS
from accelsched.observe.status_table import EXIT_CODES_HELP

__all__ = ["main", "print_events", "print_status"]

#: Seconds a connection gets at least after ``--scheduler-file`` waited for its file
#: (one ``--timeout`` covers both).
MIN_CONNECT = 1.0
#: Exit code after Ctrl-C before an answer (the shell's 128 + SIGINT).
INTERRUPTED = 130


def main(argv: list[str] | None = None) -> int:
    # a testing tool: its module (and the simulated devices) load only here
    from accelsched.testing.simulate import simulate_arguments, simulate_main

    parser = argparse.ArgumentParser(
        prog="accelsched",
        description="GPUs as real, scarce, fallible hardware for Dask's distributed scheduler.",
        epilog=f"status and events: {EXIT_CODES_HELP}",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="run a local cluster (real GPUs when NVML sees any, else simulated ones) "
        "through placement, a leak and a fallback, and write an HTML report",
    )
    demo.add_argument(
        "--report",
        metavar="PATH",
        help="where to write the report: a .html file or a folder (default "
        "accelsched-demo.html in the system's temporary folder; the path is printed)",
    )
    events = sub.add_parser(
        "events", help="print accelsched's events from a running cluster's scheduler"
    )
    _scheduler_arguments(events)
    events.add_argument(
        "--action",
        action="append",
        choices=sorted(ACTIONS),
        metavar="ACTION",
        help="only these actions (repeatable): " + ", ".join(sorted(ACTIONS)),
    )
    status = sub.add_parser(
        "status",
        help="a table per worker: verified GPUs, leases, leak estimate, quarantine, "
        "restarts, fallbacks",
        epilog=EXIT_CODES_HELP,
    )
    _scheduler_arguments(status)
    status.add_argument(
        "--json", action="store_true", help="print the snapshot as JSON (one object a line)"
    )
    status.add_argument(
        "--watch",
        nargs="?",
        const=2.0,
        type=_seconds,
        metavar="SECONDS",
        help="redraw every SECONDS (default 2) until Ctrl-C",
    )
    simulate_arguments(
        sub.add_parser(
            "simulate",
            help="run a command (dask worker, dask scheduler, python script.py) on simulated "
            "GPUs, as accelsched.testing.fake_gpus shows them",
            usage="accelsched simulate [-h] --gpus N [options] -- COMMAND [ARG ...]",
            description="Run COMMAND where NVML (pynvml, distributed, dask-cuda, accelsched) "
            "sees N simulated GPUs; exit with its exit code. Signals sent to this process "
            "reach COMMAND; the simulation is removed when it ends.",
        )
    )
    sub.add_parser("version", help="print the version")
    args = parser.parse_args(argv)
    if args.command == "simulate":
        return simulate_main(sub.choices["simulate"], args)
    if args.command == "version":
        import accelsched

        print(accelsched.__version__)
        return 0
    if args.command in ("events", "status"):
        if (args.scheduler is None) == (args.scheduler_file is None):
            sub.choices[args.command].error("give a SCHEDULER address or --scheduler-file PATH")
        from accelsched.demo.quiet import quiet_logs

        # distributed's own log lines (a reconnect that failed, ...) would come on top of
        # the one line each error is
        with quiet_logs(logging.CRITICAL):
            try:
                return _ask(args)
            except ReaderGone:  # `accelsched status --watch | head`: the reader left
                # nothing more can be written there, not even the flush at exit
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
                return 0
            except KeyboardInterrupt:  # Ctrl-C before anything was shown
                return INTERRUPTED
    from accelsched.demo import main as demo_main

    return demo_main(args.report)


def _ask(args: argparse.Namespace) -> int:
    """``status`` or ``events``: one ``--timeout`` for the scheduler file and the
    connection together, then ``--timeout`` for each answer."""

    address, connect = args.scheduler, args.timeout
    if args.scheduler_file is not None:
        deadline = time.monotonic() + args.timeout
        address = address_from_file(args.scheduler_file, deadline, args.command)
        if isinstance(address, int):
            return address
        connect = max(deadline - time.monotonic(), MIN_CONNECT)
    if args.command == "events":
        return print_events(address, args.action, sys.stdout, args.timeout, connect)
    return print_status(
        address,
        sys.stdout,
        as_json=args.json,
        watch=args.watch,
        timeout=args.timeout,
        connect=connect,
    )


def _scheduler_arguments(command: argparse.ArgumentParser) -> None:
    """Where the scheduler is (its address, or the file ``--scheduler-file`` wrote) and
    how long to try to reach it."""
    command.add_argument(
        "scheduler",
        nargs="?",
        metavar="SCHEDULER",
        help="scheduler address, e.g. tcp://127.0.0.1:8786",
    )
    command.add_argument(
        "--scheduler-file",
        metavar="PATH",
        type=_path,
        help="read the address from the file dask scheduler --scheduler-file PATH writes "
        "(waiting for it within --timeout), instead of giving SCHEDULER",
    )
    command.add_argument(
        "--timeout",
        default="10s",
        type=_timeout,
        help="how long to try to reach the scheduler, its scheduler file included (default 10s)",
    )


def _seconds(value: str) -> float:
    """``--watch`` SECONDS: a positive number."""
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0 or seconds == float("inf"):
        raise argparse.ArgumentTypeError(f"invalid SECONDS {value!r}: expected a number > 0")
    return seconds


def _path(value: str) -> str:
    if not value:
        raise argparse.ArgumentTypeError("invalid PATH '': expected a file name")
    return value


def _timeout(value: str) -> float:
    """``--timeout``: a duration (``10s``, ``500ms``, seconds), finite and > 0 (nothing
    can be reached in no time); seconds."""
    from accelsched.config import parse_optional_duration

    try:
        seconds = parse_optional_duration("--timeout", value)
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if seconds is None or seconds <= 0:
        raise argparse.ArgumentTypeError(f"invalid --timeout={value!r}: expected a duration > 0")
    return seconds


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
