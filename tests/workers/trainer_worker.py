"""What the torchrun workers here share: ``--out FILE`` and config overrides in, a Trainer of
this rank on gloo, and every rank's report gathered into ``--out`` by rank 0."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def build_trainer() -> tuple[argparse.Namespace, Any]:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    from pretrain.platform.distributed import init_distributed, launch_env
    from pretrain.train.session import build_trainer
    from recipes import load_config
    from recipes.validate import validate_runtime

    run = load_config(args.overrides)
    dp = validate_runtime(run, launch_env()[1], "cpu")
    env = init_distributed("cpu")
    return args, build_trainer(run, env, dp, Path(run.output_dir) / run.run_id)


def gather_to(out: str, mine: dict[str, Any]) -> None:
    """Rank 0 writes every rank's ``mine`` (a list, in rank order) to ``out``; then exit."""
    import torch.distributed as dist

    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.destroy_process_group()
