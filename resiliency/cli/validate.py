"""``validate``: will this checkpoint restore into that layout? Prints the diff table.

Exit codes: 0 the restore would be accepted; 3 (TOPOLOGY_REFUSED) it would be refused; 1 the
checkpoint is bad (no step of the run verifies, or the step's manifest is unreadable); 2 bad
path, overrides or target config."""

from __future__ import annotations

import argparse
from pathlib import Path

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from pretrain.context import exit_codes
from pretrain.data.tokenizer import build_tokenizer
from recipes import ConfigError, RunConfig, load_config
from recipes.validate import validate_runtime
from resiliency.cli.base import EXIT_BAD, EXIT_USAGE, Command
from resiliency.cli.run_arg import resolve_run_arg
from resiliency.storage.layout import RunLayout, parse_step
from resiliency.storage.manifest import ManifestError, read_manifest
from resiliency.storage.select import select_restore_step


def _add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "path",
        help="a run dir (newest verified step) or a step dir; a relative path that does not "
        "exist is looked up under the default output_dir (runs/)",
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        help="target config: recipe=<name> ... or overrides of the saved config",
    )
    parser.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="target world size (default: launch.nodes x launch.nproc_per_node)",
    )


class BadCheckpointError(Exception):
    """The checkpoint itself fails (exit 1), as opposed to how the tool was called (exit 2)."""


def _step_dir(value: str) -> Path:
    path = resolve_run_arg(value)
    if isinstance(path, str):
        raise ConfigError(path)
    if not path.is_dir():
        raise ConfigError(f"{path} does not exist or is not a directory")
    if parse_step(path.name) is not None:
        return path
    layout = RunLayout.from_run_dir(path)
    if not layout.steps_dir.is_dir():
        raise ConfigError(f"{path} is neither a step dir (step-NNNNNNNNN) nor a run dir")
    selection = select_restore_step(layout, layout.run_id, full_verify=False)
    for name, reason in selection.skipped:
        print(f"skipped {name}: {reason}")
    if selection.step_dir is None:
        raise BadCheckpointError("no published step verifies (the skipped lines say why)")
    return selection.step_dir


def _target_config(saved: dict, overrides: list[str]) -> RunConfig:
    if any(o.startswith("recipe=") for o in overrides):
        return load_config(overrides)
    merged = OmegaConf.merge(
        OmegaConf.structured(RunConfig), saved, OmegaConf.from_dotlist(overrides)
    )
    run = OmegaConf.to_object(merged)
    assert isinstance(run, RunConfig)
    return run


def _run(args: argparse.Namespace) -> int:
    try:
        step_dir = _step_dir(args.path)
        manifest = read_manifest(step_dir)
    except (BadCheckpointError, ManifestError) as exc:
        print(f"BAD {args.path}: {exc}")
        return EXIT_BAD
    except ConfigError as exc:
        print(f"error: {exc}")
        return EXIT_USAGE
    try:
        run = _target_config(manifest.config, args.overrides)
        world = args.world_size or run.launch.world_size
        dp = validate_runtime(run, world, "cuda" if run.launch.gpus_per_node else "cpu")
        vocab = build_tokenizer(run.data.tokenizer, run.data.tokenizer_path).vocab_size
    except (ValueError, OmegaConfBaseException) as exc:  # ConfigError, TokenizerError, merges
        print(f"error: {exc}")
        return EXIT_USAGE
    # torch comes with these: imported here so ls, verify, gc and plan start in a fraction
    # of the time.
    from resiliency.checkpoint.restore.preflight import target_for
    from resiliency.checkpoint.restore.topology import validate

    report = validate(manifest, target_for(run, world, dp, vocab))
    print(f"checkpoint: {step_dir} (step {manifest.step}, {manifest.optim_format})")
    print(report.table())
    return exit_codes.TOPOLOGY_REFUSED if report.refused else exit_codes.OK


COMMANDS = {
    "validate": Command(
        "check a checkpoint against a target layout, nothing loaded (exit 3: refused)",
        _add_args,
        _run,
        overrides=True,
    )
}
