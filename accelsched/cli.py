"""Command line: ``accelsched demo`` (also ``python -m accelsched demo``)."""

from __future__ import annotations

import argparse
import sys
import time
from typing import TextIO


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="accelsched",
        description="GPUs as real, scarce, fallible hardware for Dask's distributed scheduler.",
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
        "--timeout", default="10s", help="how long to try to reach the scheduler (default 10s)"
    )
    sub.add_parser("version", help="print the version")
    args = parser.parse_args(argv)
    if args.command == "version":
        import accelsched

        print(accelsched.__version__)
        return 0
    if args.command == "events":
        return print_events(args.scheduler, args.action, sys.stdout, timeout=args.timeout)
    from accelsched.demo import main as demo_main

    return demo_main(args.report)


def print_events(address: str, actions: list[str] | None, out: TextIO, timeout: str = "10s") -> int:
    """``accelsched events``: the scheduler's accelsched events, oldest first."""
    from distributed import Client

    from accelsched import events

    unknown = sorted(set(actions or ()) - events.ACTIONS)
    if unknown:
        print(f"unknown action(s) {unknown}; known: {sorted(events.ACTIONS)}", file=sys.stderr)
        return 2
    try:
        client = Client(address, timeout=timeout)
    except (OSError, TimeoutError) as exc:
        print(f"accelsched events: cannot reach a scheduler at {address}: {exc}", file=sys.stderr)
        return 1
    with client:
        info = client.scheduler_info(n_workers=-1)["workers"]
        names = {addr: str(w["name"]) for addr, w in info.items()}
        for stamp, msg in client.get_events(events.TOPIC):
            if not isinstance(msg, dict) or msg.get("action") not in events.ACTIONS:
                continue  # any client may log to any topic: not one of ours
            if actions and msg["action"] not in actions:
                continue
            when = time.strftime("%H:%M:%S", time.localtime(stamp))
            print(f"{when} [{msg['action']}] {events.describe(msg, names)}", file=out)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
