"""``python -m resiliency <command>``: a registry of subcommands contributed by modules.

A module joins the CLI by defining ``COMMANDS: dict[str, Command]`` and being listed in
COMMAND_MODULES; it is imported only when the CLI runs, keeping import cycles out.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from dataclasses import dataclass
from typing import Callable

COMMAND_MODULES = ("resiliency.cli_ckpt", "resiliency.cli_validate", "resiliency.plan",
                   "resiliency.drill")

EXIT_OK, EXIT_BAD, EXIT_USAGE = 0, 1, 2


@dataclass(frozen=True)
class Command:
    help: str
    add_args: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def load_commands() -> dict[str, Command]:
    commands: dict[str, Command] = {}
    for module_name in COMMAND_MODULES:
        for name, command in importlib.import_module(module_name).COMMANDS.items():
            if name in commands:
                raise RuntimeError(f"subcommand {name!r} registered twice ({module_name})")
            commands[name] = command
    return commands


def build_parser(commands: dict[str, Command]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m resiliency",
                                     description="Inspect and maintain fault-tolerant runs.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log INFO messages")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, command in commands.items():
        sp = sub.add_parser(name, help=command.help, description=command.help)
        command.add_args(sp)
        sp.set_defaults(_run=command.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser(load_commands()).parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    return int(args._run(args))
