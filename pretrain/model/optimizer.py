"""Megatron optimizer (optionally distributed) and OptimizerParamScheduler from our configs."""

from __future__ import annotations

from typing import Any

import torch

from recipes.config.optim import OptimizerConfig, SchedulerConfig
from recipes.config.perf import PerfConfig


def build_optimizer(
    cfg: OptimizerConfig, ddp_chunks: list[Any], tcfg: Any, bf16: bool, perf: PerfConfig
) -> Any:
    # megatron-core: imported after the CPU shim is applied (pretrain/platform/distributed.py)
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig as McoreOptimizerConfig
    from megatron.core.optimizer import get_megatron_optimizer

    mcore_cfg = McoreOptimizerConfig(
        optimizer=cfg.name,
        lr=cfg.lr,
        min_lr=cfg.min_lr,
        weight_decay=cfg.weight_decay,
        adam_beta1=cfg.adam_beta1,
        adam_beta2=cfg.adam_beta2,
        adam_eps=cfg.adam_eps,
        clip_grad=cfg.clip_grad,
        use_distributed_optimizer=cfg.use_distributed_optimizer,
        bf16=bf16,
        fp16=False,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
    )
    optimizer = get_megatron_optimizer(mcore_cfg, ddp_chunks)
    # The pipeline schedules call these hooks from the model config, as in Megatron-LM.
    tcfg.finalize_model_grads_func = finalize_model_grads
    tcfg.grad_scale_func = optimizer.scale_loss
    tcfg.no_sync_func = _per_chunk([chunk.no_sync for chunk in ddp_chunks])
    if perf.overlap_grad_reduce:  # Megatron-LM's align_grad_reduce: the schedule starts them
        tcfg.grad_sync_func = _per_chunk([chunk.start_grad_sync for chunk in ddp_chunks])
    if perf.overlap_param_gather:  # and align_param_gather
        tcfg.param_sync_func = _per_chunk([chunk.start_param_sync for chunk in ddp_chunks])
    return optimizer


def _per_chunk(funcs: list[Any]) -> Any:
    """One function for a single model chunk, a list under virtual pipelining (megatron)."""
    return funcs[0] if len(funcs) == 1 else funcs


def build_scheduler(
    cfg: SchedulerConfig, opt_cfg: OptimizerConfig, optimizer: Any, train_steps: int
) -> Any:
    # megatron-core: imported after the CPU shim is applied (pretrain/platform/distributed.py)
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    decay_steps = cfg.decay_steps or train_steps
    start_wd = opt_cfg.weight_decay if cfg.start_weight_decay is None else cfg.start_weight_decay
    end_wd = opt_cfg.weight_decay if cfg.end_weight_decay is None else cfg.end_weight_decay
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if cfg.warmup_steps else opt_cfg.lr,
        max_lr=opt_cfg.lr,
        min_lr=opt_cfg.min_lr,
        lr_warmup_steps=cfg.warmup_steps,
        lr_decay_steps=max(decay_steps, cfg.warmup_steps + 1),
        lr_decay_style=cfg.decay_style,
        start_wd=start_wd,
        end_wd=end_wd,
        wd_incr_steps=decay_steps,
        wd_incr_style=cfg.weight_decay_incr_style,
    )
