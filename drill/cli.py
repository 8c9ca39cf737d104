"""The drill's command line: one experiment per invocation, exit 0 only if every check passed."""

from __future__ import annotations

import argparse

from drill.experiment import add_args, run_from_args
from resiliency.cli import configure_cli_logging


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m drill",
        description="run the fault-recovery drill and write an acceptance report",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log INFO messages")
    add_args(parser)
    args = parser.parse_args(argv)
    configure_cli_logging(args.verbose)
    return run_from_args(args)
