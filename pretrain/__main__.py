"""``python -m pretrain recipe=<name> [key=value ...]``: run under torchrun or ft_launcher."""

from __future__ import annotations

import logging
import sys

from pretrain import exit_codes
from pretrain.logs import setup_logging
from recipes import ConfigError, load_config, to_yaml
from recipes.load import load_config_file, schema_keys
from recipes.validate import resolve_device, validate_runtime

log = logging.getLogger(__name__)
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

        device = resolve_device(run.train.device, torch.cuda.is_available())
        dp = validate_runtime(run, launch_env()[1], device)
    except ConfigError as exc:
        log.error("config error: %s", exc)
        return exit_codes.CONFIG_ERROR
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
