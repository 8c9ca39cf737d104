"""``python -m launch {local,slurm,k8s} [options] key=value ...``"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from types import ModuleType

from pretrain.context import exit_codes, interrupts
from pretrain.platform.logs import setup_logging
from recipes import ConfigError, load_config
from recipes.cli_args import config_dir_override, refuse_sweep, sweep_points, translate
from recipes.inputs import DataInputError
from recipes.load import starting_from

# backend name -> module with add_arguments(parser) and run(args, overrides) -> int
BACKENDS = {"local": "launch.local", "slurm": "launch.slurm.cli", "k8s": "launch.k8s.cli"}
SWEEP_FLAGS = ("-m", "--multirun")
OVERRIDES_EPILOG = (
    "Everything after the options is a Hydra override of the run config: key=value, "
    "+key=value, ~key (unset), hydra.run.dir=DIR (= output_dir). A sweep needs -m/--multirun: "
    "-m a=1,2 b=range(3) runs one launch per point (Slurm and Kubernetes: one job per point); "
    "without -m a comma is refused (a list is key=[a,b]). "
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
        _add_config_arguments(backend_parser)
        modules[name].add_arguments(backend_parser)
    return parser, modules


def _add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """What every backend composes from: the package's recipes, a user's, or a config file."""
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="start from this config file (a resolved config: `python -m pretrain ... --cfg job "
        "--resolve`, or a run's launch-config.yaml) instead of a recipe; overrides apply on top",
    )
    parser.add_argument(
        "--config-dir",
        "-cd",
        metavar="DIR",
        help="more recipe and group files: DIR/recipe/<name>.yaml is recipe=<name> "
        "(as hydra.searchpath=[file://DIR])",
    )


# Once the ranks run, the backend forwards a Ctrl-C to them (docs/fault-tolerance.md#ctrl-c).
@interrupts.one_line_on_ctrl_c("before any rank started")
def main(argv: list[str]) -> int:
    setup_logging("INFO")
    parser, modules = _parser()
    args, rest = parser.parse_known_args(argv)
    backend = modules[args.backend]
    try:
        multirun, overrides = _split_overrides(rest, args)
        with starting_from(args.config):
            if not multirun:
                refuse_sweep(overrides)
                return backend.run(args, overrides)
            return _sweep(backend, args, overrides)
    except ConfigError as exc:
        log.error("%s", exc)
        return exit_codes.DATA if isinstance(exc, DataInputError) else exit_codes.CONFIG_ERROR


def _split_overrides(rest: list[str], args: argparse.Namespace) -> tuple[bool, list[str]]:
    """(-m given, the overrides translated); an option no backend knows is refused here, not
    handed to Hydra's grammar as an override (whose error would not name it)."""
    unknown = [a for a in rest if a.startswith("-") and a not in SWEEP_FLAGS]
    if unknown:
        raise ConfigError(
            f"unknown option {unknown[0]!r} for launch {args.backend}; "
            f"options: python -m launch {args.backend} --help"
        )
    overrides = [a for a in rest if a not in SWEEP_FLAGS]
    multirun = len(overrides) < len(rest)
    if args.config_dir is not None:  # last: `launch slurm logs NAME` reads its first two
        overrides.append(config_dir_override(args.config_dir))
    return multirun, translate(overrides)


def _sweep(backend: ModuleType, args: argparse.Namespace, overrides: list[str]) -> int:
    """One launch per point, one after another; every point composes before the first one
    starts, so a bad value in the last point does not cost the first ones' runs."""
    points = sweep_points(overrides)
    for point in points:
        load_config(point)
    for i, point in enumerate(points):
        log.info("sweep point %d/%d: %s", i + 1, len(points), " ".join(point))
        code = backend.run(args, point)
        if code != 0:
            log.error("sweep point %d/%d ended with exit %d; stopping", i + 1, len(points), code)
            return code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


def cli() -> None:
    """``mcore-launch`` (pyproject.toml's scripts): ``python -m launch``, same exit codes."""
    sys.exit(main(sys.argv[1:]))
