"""torchrun worker: the bytes a real run allocates for weights, gradients and optimizer state,
after one step (the optimizer state exists from then on). Rank 0 writes every rank's
{"weights", "grads", "optimizer"} to ``--out``."""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path
from typing import Any

warnings.simplefilter("ignore")


def _bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import torch
    import torch.distributed as dist

    from pretrain.distributed import init_distributed, launch_env
    from pretrain.loop import Trainer
    from recipes import load_config
    from recipes.validate import validate_runtime

    run = load_config(args.overrides)
    dp = validate_runtime(run, launch_env()[1], "cpu")
    env = init_distributed("cpu")
    trainer = Trainer(run, env, dp, Path(run.output_dir) / run.run_id, [])
    trainer.train_step()
    parts = trainer.parts
    params = [p for chunk in parts.chunks for p in chunk.parameters()]
    grads = [
        buf.grad_data for ddp in parts.ddp for buf in ddp.buffers + ddp.expert_parallel_buffers
    ]
    optimizers = getattr(parts.optimizer, "chained_optimizers", [parts.optimizer])
    state = [
        t
        for opt in optimizers
        for per_param in opt.optimizer.state.values()
        for t in per_param.values()
        if isinstance(t, torch.Tensor) and t.numel() > 1
    ]
    mine = {"weights": _bytes(params), "grads": _bytes(grads), "optimizer": _bytes(state)}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if env.rank == 0:
        Path(args.out).write_text(json.dumps(gathered))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
