"""One global batch through megatron-core's pipeline schedule: the forward step, the loss, and
the call shared by training (forward and backward) and evaluation (forward only)."""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from typing import Any

import torch

from pretrain.data import dataset as data


def _loss_func(
    loss_mask: torch.Tensor, output: torch.Tensor, scale: float = 1.0
) -> tuple[torch.Tensor, dict]:
    losses = output.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask) / mask.sum().clamp(min=1.0)
    if scale != 1.0:  # train.fault=spike@N: a bad batch (tests)
        loss = loss * scale
    return loss, {"lm loss": loss.detach().clone()}


def forward_step(
    device: torch.device, batches: Iterator[dict], model: Any, loss_scale: float = 1.0
) -> tuple:
    batch = data.to_device(next(batches), device)
    output = model(
        batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"]
    )
    return output, partial(_loss_func, batch["loss_mask"], scale=loss_scale)


def run_schedule(
    parts: Any,
    device: torch.device,
    seq_length: int,
    batches: list[dict],
    forward_only: bool,
    loss_scale: float = 1.0,
) -> list[dict]:
    """The microbatches of one global batch through every model chunk (pipeline schedule
    for this layout); the per-microbatch loss dicts on the last pipeline stage (each loss
    multiplied by ``loss_scale``: fault injection only)."""
    # megatron-core: imported after the CPU shim is applied (pretrain/platform/distributed.py)
    from megatron.core.pipeline_parallel import get_forward_backward_func

    iterators = [iter(batches) for _ in parts.ddp]
    return get_forward_backward_func()(
        forward_step_func=partial(forward_step, device, loss_scale=loss_scale),
        data_iterator=iterators if len(iterators) > 1 else iterators[0],
        model=parts.ddp if len(parts.ddp) > 1 else parts.ddp[0],
        num_microbatches=parts.plan.num_microbatches,
        seq_length=seq_length,
        micro_batch_size=parts.plan.micro_batch_size,
        forward_only=forward_only,
    )
