"""``python -m launch {local,slurm,k8s} [options] key=value ...``"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from types import ModuleType

from pretrain.context import exit_codes
from pretrain.platform.logs import setup_logging
from recipes import ConfigError
from recipes.cli_args import has_sweep, sweep_points, translate
from recipes.inputs import DataInputError

# backend name -> module with add_arguments(parser) and run(args, overrides) -> int
BACKENDS = {"local": "launch.local", "slurm": "launch.slurm.cli", "k8s": "launch.k8s.cli"}
SWEEP_FLAGS = ("-m", "--multirun")
OVERRIDES_EPILOG = (
    "Everything after the options is a Hydra override of the run config: key=value, "
    "+key=value, ~key (unset), hydra.run.dir=DIR (= output_dir); with -m/--multirun, "
    "a=1,2 b=range(3) sweep: one launch per point (Slurm and Kubernetes: one job per point). "
    "Keys: python -m pretrain --show-keys; recipes: python -m pretrain --help."
)
log = logging.getLogger(__name__)


def _parser() -> tuple[argparse.ArgumentParser, dict[str, ModuleType]]:
    parser = argparse.ArgumentParser(
        prog="python -m launch",
        description="Launch a run here (local), on Slurm, or on Kubernetes (PyTorchJob).",
        epilog=OVERRIDES_EPILOG,
    )
    sub = parser.add_subparsers(dest="backend", required=True, metavar="{local,slurm,k8s}")
    modules = {}
    for name, module_name in BACKENDS.items():
        try:
            modules[name] = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue
        doc = modules[name].__doc__ or name
        backend_parser = sub.add_parser(
            name,
            help=doc.splitlines()[0],
            description=doc,
            epilog=OVERRIDES_EPILOG,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        modules[name].add_arguments(backend_parser)
    return parser, modules


def main(argv: list[str]) -> int:
    setup_logging("INFO")
    parser, modules = _parser()
    args, overrides = parser.parse_known_args(argv)
    sweep = any(o in SWEEP_FLAGS for o in overrides)
    overrides = [o for o in overrides if o not in SWEEP_FLAGS]
    try:
        overrides = translate(overrides)
        if not (sweep or has_sweep(overrides)):
            return modules[args.backend].run(args, overrides)
        points = sweep_points(overrides)
        for i, point in enumerate(points):
            log.info("sweep point %d/%d: %s", i + 1, len(points), " ".join(point))
            code = modules[args.backend].run(args, point)
            if code != 0:
                log.error(
                    "sweep point %d/%d ended with exit %d; stopping", i + 1, len(points), code
                )
                return code
        return 0
    except ConfigError as exc:
        log.error("%s", exc)
        return exit_codes.DATA if isinstance(exc, DataInputError) else exit_codes.CONFIG_ERROR


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
