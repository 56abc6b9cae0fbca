"""Command line: ``accelsched demo|status|events|version`` (also ``python -m accelsched``).

``status`` and ``events`` live in :mod:`accelsched.status`, with their exit codes.
"""

from __future__ import annotations

import argparse
import sys

from accelsched.status import EXIT_CODES_HELP, print_events, print_status

__all__ = ["main", "print_events", "print_status"]


def main(argv: list[str] | None = None) -> int:
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
        help="where to write the report: a .html file or a folder (default ./accelsched-demo.html)",
    )
    events = sub.add_parser(
        "events", help="print accelsched's events from a running cluster's scheduler"
    )
    events.add_argument("scheduler", help="scheduler address, e.g. tcp://127.0.0.1:8786")
    events.add_argument("--action", action="append", help="only these actions (repeatable)")
    events.add_argument(
        "--timeout",
        default="10s",
        type=_timeout,
        help="how long to try to reach the scheduler (default 10s)",
    )
    status = sub.add_parser(
        "status",
        help="a table per worker: verified GPUs, leases, leak estimate, quarantine, "
        "restarts, fallbacks",
        epilog=EXIT_CODES_HELP,
    )
    status.add_argument("scheduler", help="scheduler address, e.g. tcp://127.0.0.1:8786")
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
    status.add_argument(
        "--timeout",
        default="10s",
        type=_timeout,
        help="how long to try to reach the scheduler (default 10s)",
    )
    sub.add_parser("version", help="print the version")
    args = parser.parse_args(argv)
    if args.command == "version":
        import accelsched

        print(accelsched.__version__)
        return 0
    if args.command == "events":
        return print_events(args.scheduler, args.action, sys.stdout, timeout=args.timeout)
    if args.command == "status":
        return print_status(
            args.scheduler, sys.stdout, as_json=args.json, watch=args.watch, timeout=args.timeout
        )
    from accelsched.demo import main as demo_main

    return demo_main(args.report)


def _seconds(value: str) -> float:
    """``--watch`` SECONDS: a positive number."""
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0 or seconds == float("inf"):
        raise argparse.ArgumentTypeError(f"invalid SECONDS {value!r}: expected a number > 0")
    return seconds


def _timeout(value: str) -> str:
    """``--timeout``: a duration (``10s``, ``500ms``, seconds), finite and >= 0, passed on
    in seconds (dask alone reads ``.5s`` as 1.5 s)."""
    from accelsched.config import parse_optional_duration

    try:
        seconds = parse_optional_duration("--timeout", value)
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if seconds is None:
        raise argparse.ArgumentTypeError(f"invalid --timeout={value!r}: expected a duration")
    return f"{seconds!r}s"


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
