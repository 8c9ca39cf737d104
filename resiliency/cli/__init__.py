"""``python -m resiliency <command>``: checkpoint inspection (ls, verify, gc), restore
validation and capacity planning. Each subcommand module defines ``COMMANDS`` (see base.py),
and base.py documents the exit codes they share."""

from __future__ import annotations

import argparse
import logging
import sys

from resiliency.cli import capacity, checkpoints, goodput, remote, validate
from resiliency.cli.base import EXIT_CODES_EPILOG, Command

COMMAND_MODULES = (checkpoints, remote, goodput, validate, capacity)
OVERRIDES_NOTE = "takes Hydra overrides: recipe=<name> key=value ..."


def load_commands() -> dict[str, Command]:
    commands: dict[str, Command] = {}
    for module in COMMAND_MODULES:
        for name, command in module.COMMANDS.items():
            if name in commands:
                raise RuntimeError(f"subcommand {name!r} registered twice ({module.__name__})")
            commands[name] = command
    return commands


def commands_epilog(commands: dict[str, Command]) -> str:
    """One unwrapped line per subcommand (argparse's own list wraps and hides the overrides)."""
    width = max(map(len, commands)) + 2
    lines = ["commands:"]
    first: dict[int, str] = {}  # a command registered under a second name is an old alias
    for name, command in commands.items():
        alias_of = first.setdefault(id(command), name)
        help_text = command.help if alias_of == name else f"the old name of {alias_of}"
        lines.append(f"  {name:<{width}}{help_text}")
    lines.append(f"  {'soak':<{width}}chaos soak under random faults (python -m drill.soak)")
    takes = [name for name, command in commands.items() if command.overrides]
    takes = [name for name in takes if first[id(commands[name])] == name]
    lines += [
        "",
        f"Hydra overrides (recipe=<name> key=value ...) are accepted by: {', '.join(takes)}.",
        "`python -m resiliency <command> --help` for a command's arguments.",
        EXIT_CODES_EPILOG,
    ]
    return "\n".join(lines)


def build_parser(commands: dict[str, Command]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m resiliency",
        description="Inspect and maintain fault-tolerant runs.",
        epilog=commands_epilog(commands),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log INFO messages")
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="<command>", help="one of the commands below"
    )
    for name, command in commands.items():
        description = command.help + (f"\n({OVERRIDES_NOTE})" if command.overrides else "")
        sp = sub.add_parser(
            name,
            description=description,
            epilog="\n".join(filter(None, (command.epilog, EXIT_CODES_EPILOG))),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
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
