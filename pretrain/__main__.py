"""``python -m pretrain recipe=<name> [key=value ...]``: run under torchrun or ft_launcher."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time

from omegaconf import OmegaConf

from pretrain.context import exit_codes, interrupts
from pretrain.context.early_start import start_early
from pretrain.fit.timing import resolve_save_interval
from pretrain.platform.logs import setup_logging
from recipes import ConfigError, RunConfig, load_config, to_yaml
from recipes.cli_args import CliRequest, parse_args, refuse_sweep, sweep_points
from recipes.cli_args import translate as translate_overrides
from recipes.describe import catalogue, composed_keys, describe_keys, format_keys
from recipes.inputs import DataInputError, check_environment, check_inputs
from recipes.load import CONF_DIR, compose_tree, load_config_file
from recipes.validate import resolve_device, resolve_run_id, validate_runtime

log = logging.getLogger(__name__)
# Set by torchrun and ft_launcher: one id per launch, kept by its in-place restarts.
LAUNCH_ID_ENV = "TORCHELASTIC_RUN_ID"
CONFIG_ERROR_GRACE_S = 2.0
USAGE = """\
usage: python -m pretrain (recipe=<name> | --config RESOLVED.yaml) [key=value ...] [options]
  Hydra override grammar (key=value, +key=value, ~key); run the ranks under
  `torchrun --nproc-per-node N -m pretrain ...`, or use `python -m launch local|slurm|k8s ...`.
options:
  --cfg job|hydra|all  print the composed config (Hydra's --cfg) and exit; --resolve resolves it
  --info               where the config comes from: search path, the options each group got
  -m, --multirun       sweep (a=1,2 b=range(3)...): one run per point, one after another
  --show-keys [FILTER] every key (containing FILTER) with its type, default and description;
                       with recipe=... and overrides, the composed values instead
  --plan               parameters and memory per GPU at the recipe's layout, built on the meta
                       device (no GPU, no memory); --gpu h100-80gb|h200-141gb|a100-80gb|<GiB>
                       (default: launch.gpu),
                       --vocab N (without the tokenizer's files), --json; exit 1: does not fit
  --config FILE        a resolved config written by a launcher (pins the run)
  --config-dir DIR     also take recipes and group options from DIR/<group>/<name>.yaml
  hydra.run.dir=DIR    the output dir (as output_dir=DIR); other hydra.* keys are refused
exit codes: 0 ok, 2 config error, 9 missing data or tokenizer files, 130 Ctrl-C (after the
  emergency save); all in docs/reference/exit-codes.md
"""


@interrupts.one_line_on_ctrl_c("before training started: nothing was saved")
def main(argv: list[str]) -> int:
    setup_logging("INFO")
    try:
        req = parse_args(argv)
        req.overrides = translate_overrides(req.overrides)
        if req.help:
            print(USAGE + "\n" + catalogue())
            return 0
        if req.show_keys:
            return _show_keys(req)
        if req.cfg or req.info:
            return _print_config(req)
        if req.plan:
            return _plan(req)
        if req.multirun:
            return _sweep(req)
        refuse_sweep(req.overrides)  # a comma without -m: one line, never one run per value
        # From here on a Ctrl-C is a stop request: the ranks agree on it at the end of a step,
        # make the emergency save and exit 130 (no KeyboardInterrupt in the middle of a step).
        interrupts.install()
        run, device, dp = _prepare(_load(req))
    except ConfigError as exc:
        # Every rank composed the same config and found the same error: said once, by rank 0.
        first = _first_rank()
        log.log(logging.ERROR if first else logging.DEBUG, "config error: %s", exc)
        if not first:
            _let_rank_0_say_it()
        return exit_codes.DATA if isinstance(exc, DataInputError) else exit_codes.CONFIG_ERROR
    # torch and megatron-core: not for --help/--cfg
    from pretrain.train.session import train

    return train(run, device, dp)


def _let_rank_0_say_it() -> None:
    """The launcher stops every rank once the first one exits: the others exit after rank 0,
    so its line is written, and with the same code (the launcher's SIGTERM waits, or the
    retry policy would read a rank killed by a signal as an infrastructure failure)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(CONFIG_ERROR_GRACE_S)


def _show_keys(req: CliRequest) -> int:
    """--show-keys [FILTER] [recipe=... overrides]: with overrides, the composed values."""
    if req.overrides or req.config_file:
        keys = composed_keys(_load(req), req.keys_filter)
    else:
        keys = [k for k in describe_keys() if req.keys_filter is None or req.keys_filter in k.key]
    if not keys:
        raise ConfigError(f"no config key contains {req.keys_filter!r}")
    print(format_keys(keys))
    return 0


def _plan(req: CliRequest) -> int:
    """--plan: the recipe's model built on the meta device, memory per GPU, fit (exit 0 when it
    fits, 1 when it does not)."""
    if req.config_file:
        raise ConfigError("--plan takes recipe=<name> [overrides], not --config")
    if req.gpu is not None:  # a name is checked before torch is imported (seconds)
        from recipes.gpus import gpu_bytes

        gpu_bytes(req.gpu)
    # torch and megatron-core: only for --plan
    from pretrain.fit.cli import as_json, make_plan, report

    plan = make_plan(req.overrides, req.gpu, req.vocab)
    print(as_json(plan) if req.json else report(plan))
    return 0 if plan.fits else 1


def _first_rank() -> bool:
    return os.environ.get("RANK", "0") == "0"


def _launcher_hint(run: RunConfig, world_size: int) -> str:
    """A layout of several ranks started as one plain process: name the lines that start it."""
    ranks = run.parallel.model_parallel_size * (run.parallel.dp or 1)
    if world_size != 1 or "WORLD_SIZE" in os.environ or ranks == 1:
        return ""
    args = " ".join(sys.argv[1:])
    return (
        f". `python -m pretrain` is one process and this layout needs {ranks} ranks: start it "
        f"with `torchrun --standalone --nproc-per-node {ranks} -m pretrain {args}` or "
        f"`python -m launch local launch.nproc_per_node={ranks} {args}`"
    )


def _load(req: CliRequest) -> RunConfig:
    if req.config_file:
        return load_config_file(req.config_file, req.overrides)
    return load_config(req.overrides)


def _print_config(req: CliRequest) -> int:
    """Hydra's --cfg / --info: composed and validated like a run, then printed."""
    run = _load(req)
    if req.config_file:  # a pinned config has no composition to show: it is the config
        print(to_yaml(run), end="")
        return 0
    tree = compose_tree(req.overrides, with_hydra=req.info or req.cfg in ("hydra", "all"))
    if req.info:
        choices = OmegaConf.to_container(tree.hydra.runtime.choices)
        print(f"config search path: {CONF_DIR} (primary config: config.yaml)")
        print("options chosen per group (defaults list, after recipe and overrides):")
        groups = {g: o for g, o in sorted(choices.items()) if not g.startswith("hydra/")}
        for group, option in groups.items():
            print(f"  {group}: {option}")
        print(f"overrides: {req.overrides}")
        _print_value_sources(req.overrides, groups, tree)
        return 0
    if req.cfg == "job":
        OmegaConf.set_struct(tree, False)
        tree.pop("hydra", None)
    elif req.cfg == "hydra":
        tree = tree.hydra
    if req.cfg != "job":
        print("# Hydra's own node as composed; only hydra.run.dir and hydra.sweep.dir act here")
    print(OmegaConf.to_yaml(tree, resolve=req.resolve), end="")
    return 0


def _print_value_sources(overrides: list[str], groups: dict[str, str], tree: object) -> None:
    """Where the composed values differ from the chosen group options: the recipe set them
    (its own lines or the recipes it extends), or an override on this command line."""
    recipe = groups.get("recipe")
    options = [f"{group}={option}" for group, option in groups.items() if group != "recipe"]
    plain = compose_tree(["~recipe", *options])
    given = {o.split("=", 1)[0].lstrip("+~") for o in overrides if "=" in o}
    rows = []
    for info in describe_keys():
        value = OmegaConf.select(tree, info.key)
        if value != OmegaConf.select(plain, info.key):
            source = "override" if info.key in given else f"recipe {recipe}"
            rows.append((info.key, value, source))
    if not rows:
        print("values: every one as its group option (or the schema default) sets it")
        return
    print("values the group options do not set (from the recipe and its bases, or overrides):")
    width = max(len(key) for key, _, _ in rows)
    for key, value, source in rows:
        print(f"  {key:<{width}}  = {value!r}  ({source})")


def _sweep(req: CliRequest) -> int:
    """Each point a complete run in its own process, one after another (Hydra's basic
    launcher); under torchrun every rank would run every point, so that is refused."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError(
            "a -m sweep under torchrun would run every point in every rank: sweep with "
            "`python -m launch local -m ...` (one launch per point) or `python -m launch "
            "slurm -m ...` (one job per point)"
        )
    points = sweep_points(req.overrides)
    for point in points:  # every point validated before the first one trains
        _load(CliRequest(overrides=point, config_file=req.config_file))
    for i, point in enumerate(points):
        log.info("sweep point %d/%d: %s", i + 1, len(points), " ".join(point))
        extra = ["--config", req.config_file] if req.config_file else []
        code = subprocess.call([sys.executable, "-m", "pretrain", *extra, *point])
        if code != 0:
            log.error(
                "sweep point %d/%d failed (exit %d); stopping the sweep", i + 1, len(points), code
            )
            return code
    return 0


def _prepare(run: RunConfig) -> tuple[RunConfig, str, int]:
    """Checks that need no process group: files, the run's name, the device and layout."""
    run = resolve_save_interval(run)  # "auto" (a launcher pins the number it resolved)
    check_inputs(run)  # before torch, megatron-core and the process group
    check_environment(run)
    # torchrun's environment, read here: torch is not imported yet
    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    named = resolve_run_id(run, os.environ.get(LAUNCH_ID_ENV), world_size)
    start_early(named)  # e.g. the checkpoint's files read ahead while torch imports
    # torch: not for --help/--cfg
    import torch

    device = resolve_device(run.train.device, torch.cuda.is_available())
    try:
        dp = validate_runtime(named, world_size, device)
    except ConfigError as exc:
        raise ConfigError(f"{exc}{_launcher_hint(run, world_size)}") from None
    if run.run_id is None and rank == 0:
        log.info(
            "run_id not set: new run %r in %s/ (continue it later with run_id=%s)",
            named.run_id,
            named.output_dir,
            named.run_id,
        )
    return named, device, dp


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


def cli() -> None:
    """``mcore-pretrain`` (pyproject.toml's scripts): ``python -m pretrain``, same exit codes."""
    sys.exit(main(sys.argv[1:]))
