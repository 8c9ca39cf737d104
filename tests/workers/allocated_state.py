"""torchrun worker: the bytes a real run allocates for weights, gradients and optimizer state,
after one step (the optimizer state exists from then on). Rank 0 writes every rank's
{"weights", "grads", "optimizer"} to ``--out``."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

warnings.simplefilter("ignore")


def _bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import torch

    from tests.workers.trainer_worker import build_trainer, gather_to

    args, trainer = build_trainer()
    trainer.train_step()
    parts = trainer.parts
    params = [p for chunk in parts.chunks for p in chunk.parameters()]
    buffers = [buf for ddp in parts.ddp for buf in ddp.buffers + ddp.expert_parallel_buffers]
    grads = [buf.grad_data for buf in buffers]
    optimizers = getattr(parts.optimizer, "chained_optimizers", [parts.optimizer])
    state = [
        t
        for opt in optimizers
        for per_param in opt.optimizer.state.values()
        for t in per_param.values()
        if isinstance(t, torch.Tensor) and t.numel() > 1
    ]
    gather_to(
        args.out, {"weights": _bytes(params), "grads": _bytes(grads), "optimizer": _bytes(state)}
    )


if __name__ == "__main__":
    main()
