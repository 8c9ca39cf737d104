"""Validation: forward-only passes over fixed batches of a held-out split.

Every evaluation reads the same first ``eval_iters`` global batches of its split (as
torchtitan's validator does), so successive values are comparable and a restarted run
evaluates exactly what an uninterrupted one would. Nothing here moves the training state: the
train data cursor is untouched, every RNG stream is captured before and restored after
(pretrain/platform/rng.py), dropout is off, and no gradient is kept.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from pretrain.data import dataset as data
from pretrain.platform.rng import preserved_rng
from pretrain.train.schedule import run_schedule


@contextlib.contextmanager
def params_synced(ddp_chunks: list[Any], overlap_param_gather: bool) -> Iterator[None]:
    """With the parameter all-gather overlapped into the next forward pass, the model's
    parameters lag the optimizer until then: finish the gather first, as Megatron-LM does
    around evaluation and checkpoint saves, and re-arm the overlap after."""
    if not overlap_param_gather:
        yield
        return
    for chunk in ddp_chunks:
        chunk.disable_forward_pre_hook(param_sync=True)
    try:
        yield
    finally:
        for chunk in ddp_chunks:
            chunk.enable_forward_pre_hook()


def eval_loss(trainer: Any, dataset: Any) -> float:
    """Mean LM loss over ``train.eval_iters`` global batches of ``dataset`` (collective)."""
    # megatron-core: imported after the CPU shim is applied (pretrain/platform/distributed.py)
    from megatron.core import parallel_state as ps

    parts, run, device = trainer.parts, trainer.run, trainer.env.torch_device
    per_batch = parts.plan.global_batch_size
    local = torch.zeros(1, dtype=torch.float64, device=device)
    with preserved_rng(trainer.env.device), torch.no_grad():
        for chunk in parts.ddp:
            chunk.eval()
        try:
            for index in range(run.train.eval_iters):
                batches = data.microbatches(dataset, parts.plan, index * per_batch)
                losses = run_schedule(parts, device, run.model.seq_length, batches, True)
                if losses and ps.is_pipeline_last_stage(ignore_virtual=True):
                    local += torch.stack([x["lm loss"].double() for x in losses]).mean()
        finally:
            for chunk in parts.ddp:
                chunk.train()
    dist.all_reduce(local)  # sum over the last stage's ranks (TP/DP/CP copies alike)
    last_stage_ranks = trainer.env.world_size // run.parallel.pp
    return float(local.item()) / last_stage_ranks / run.train.eval_iters
