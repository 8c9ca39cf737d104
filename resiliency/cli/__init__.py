"""``python -m resiliency <command>``: checkpoint inspection (ls, verify, gc), restore
validation and capacity planning. Each subcommand module defines ``COMMANDS`` (see base.py)."""

from __future__ import annotations

import argparse
import logging
import sys

from resiliency.cli import capacity, checkpoints, validate
from resiliency.cli.base import Command

COMMAND_MODULES = (checkpoints, validate, capacity)


def load_commands() -> dict[str, Command]:
    commands: dict[str, Command] = {}
    for module in COMMAND_MODULES:
        for name, command in module.COMMANDS.items():
            if name in commands:
                raise RuntimeError(f"subcommand {name!r} registered twice ({module.__name__})")
            commands[name] = command
    return commands


def build_parser(commands: dict[str, Command]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m resiliency", description="Inspect and maintain fault-tolerant runs."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log INFO messages")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, command in commands.items():
        sp = sub.add_parser(name, help=command.help, description=command.help)
        command.add_args(sp)
        sp.set_defaults(_run=command.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser(load_commands()).parse_args(argv)
    configure_cli_logging(args.verbose)
    return int(args._run(args))


def configure_cli_logging(verbose: bool) -> None:
    """CLI tools log to stderr, WARNING unless -v (their stdout is the report)."""
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
