"""Checks that need the launch environment: world size and device. Run before any process group."""

from __future__ import annotations

from recipes.schema import ConfigError, RunConfig


def resolve_device(requested: str, cuda_available: bool) -> str:
    if requested == "cuda" and not cuda_available:
        raise ConfigError("train.device=cuda but no CUDA device is visible; use train.device=auto")
    if requested == "auto":
        return "cuda" if cuda_available else "cpu"
    return requested


def validate_runtime(run: RunConfig, world_size: int, device: str) -> int:
    """Validate ``run`` for ``world_size`` ranks on ``device``; returns the data-parallel size."""
    par, train = run.parallel, run.train
    if par.cp > 1 and device != "cuda":
        raise ConfigError(
            f"parallel.cp={par.cp} needs CUDA: context parallelism in megatron-core is implemented "
            "only by Transformer Engine's TEDotProductAttention. Use parallel.cp=1 on CPU."
        )
    if train.precision == "bf16" and device != "cuda":
        raise ConfigError("train.precision=bf16 is supported on CUDA only; use fp32 or auto on CPU")
    dp = par.data_parallel_size(world_size)
    per_step = train.micro_batch_size * dp
    if train.global_batch_size % per_step:
        raise ConfigError(
            f"train.global_batch_size={train.global_batch_size} must be a multiple of "
            f"train.micro_batch_size*dp = {train.micro_batch_size}*{dp} = {per_step}"
        )
    return dp


def num_microbatches(run: RunConfig, dp: int) -> int:
    return run.train.global_batch_size // (run.train.micro_batch_size * dp)
