"""``python -m launch {local,slurm,k8s} [options] key=value ...``"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from pretrain import exit_codes
from pretrain.logs import setup_logging
from recipes import ConfigError

# backend name -> module with add_arguments(parser) and run(args, overrides) -> int
BACKENDS = {"local": "launch.local", "slurm": "launch.slurm", "k8s": "launch.k8s"}
log = logging.getLogger(__name__)


def main(argv: list[str]) -> int:
    setup_logging("INFO")
    parser = argparse.ArgumentParser(prog="python -m launch")
    sub = parser.add_subparsers(dest="backend", required=True)
    modules = {}
    for name, module_name in BACKENDS.items():
        try:
            modules[name] = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue
        backend_parser = sub.add_parser(name, help=modules[name].__doc__.splitlines()[0])
        modules[name].add_arguments(backend_parser)
    args, overrides = parser.parse_known_args(argv)
    try:
        return modules[args.backend].run(args, overrides)
    except ConfigError as exc:
        log.error("%s", exc)
        return exit_codes.CONFIG_ERROR


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
