"""Command line: ``accelsched demo`` (also ``python -m accelsched demo``)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="accelsched",
        description="GPUs as real, scarce, fallible hardware for Dask's distributed scheduler.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser(
        "demo",
        help="run a local cluster (real GPUs when NVML sees any, else simulated ones) "
        "through placement, a leak and a fallback",
    )
    sub.add_parser("version", help="print the version")
    args = parser.parse_args(argv)
    if args.command == "version":
        import accelsched

        print(accelsched.__version__)
        return 0
    from accelsched.demo import run

    return run(sys.stdout)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
