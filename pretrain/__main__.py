"""``python -m pretrain recipe=<name> [key=value ...]``: run under torchrun or ft_launcher."""

from __future__ import annotations

import logging
import os
import sys

from pretrain import exit_codes
from pretrain.logs import setup_logging
from recipes import ConfigError, load_config, to_yaml
from recipes.load import load_config_file, schema_keys
from recipes.validate import resolve_device, resolve_run_id, validate_runtime

log = logging.getLogger(__name__)
# Set by torchrun and ft_launcher: one id per launch, kept by its in-place restarts.
LAUNCH_ID_ENV = "TORCHELASTIC_RUN_ID"
USAGE = (
    "usage: python -m pretrain (recipe=<name> | --config RESOLVED.yaml) [key=value ...]\n"
    "                          [--show-keys | --show-config]\n"
    "  Hydra override grammar; run under `torchrun --nproc-per-node N -m pretrain ...`.\n"
    "  --config loads a resolved config written by a launcher (python -m launch ...)."
)


def main(argv: list[str]) -> int:
    setup_logging("INFO")
    if "-h" in argv or "--help" in argv:
        print(USAGE)
        return 0
    if "--show-keys" in argv:
        print("\n".join(schema_keys()))
        return 0
    config_file, overrides = _split_args([a for a in argv if a != "--show-config"])
    try:
        run = load_config_file(config_file, overrides) if config_file else load_config(overrides)
        if "--show-config" in argv:
            print(to_yaml(run), end="")
            return 0
        # torch and megatron-core: not for --help/--show-config
        import torch

        from pretrain.distributed import launch_env

        rank, world_size, _ = launch_env()
        named = resolve_run_id(run, os.environ.get(LAUNCH_ID_ENV), world_size)
        device = resolve_device(run.train.device, torch.cuda.is_available())
        dp = validate_runtime(named, world_size, device)
    except ConfigError as exc:
        log.error("config error: %s", exc)
        return exit_codes.CONFIG_ERROR
    if run.run_id is None and rank == 0:
        log.info(
            "run_id not set: new run %r in %s/ (continue it later with run_id=%s)",
            named.run_id,
            named.output_dir,
            named.run_id,
        )
    run = named
    # torch and megatron-core: not for --help/--show-config
    from pretrain.session import train

    return train(run, device, dp)


def _split_args(argv: list[str]) -> tuple[str | None, list[str]]:
    if "--config" not in argv:
        return None, argv
    index = argv.index("--config")
    if index + 1 >= len(argv):
        raise SystemExit("--config needs a path")
    return argv[index + 1], argv[:index] + argv[index + 2 :]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
