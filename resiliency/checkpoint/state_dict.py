"""The full training state as one megatron-core sharded state dict, as Megatron-LM keys it."""

from __future__ import annotations

import contextlib
from typing import Any

from resiliency.checkpoint.optim_gather import live_fully_reshardable, staged_fully_reshardable
from resiliency.checkpoint.write.staging import Stager


def chunks_by_key(chunks: list[Any]) -> dict[str, Any]:
    """Megatron-LM's top-level checkpoint keys: "model", or "model<i>" per virtual stage."""
    if len(chunks) == 1:
        return {"model": chunks[0]}
    return {f"model{i}": chunk for i, chunk in enumerate(chunks)}


def model_state_dict(chunks: list[Any]) -> dict[str, Any]:
    return {key: chunk.sharded_state_dict() for key, chunk in chunks_by_key(chunks).items()}


def sharded_training_state(
    parts: Any,
    optim_format: str,
    is_loading: bool = False,
    with_optimizer: bool = True,
    staging: Stager | None = None,
    snapshot: bool = True,
) -> dict[str, Any]:
    """Model chunks and (optionally) optimizer as one megatron sharded state dict; with
    ``staging``, a fully-reshardable optimizer state is built into its buffers (or, without
    ``snapshot``, left in place where it can be written as it is)."""
    sharded = model_state_dict(parts.chunks)
    if with_optimizer:
        fully = optim_format == "fully_reshardable"
        if fully and is_loading:
            builder = live_fully_reshardable(parts.optimizer)
        elif fully and staging is not None:
            builder = staged_fully_reshardable(parts.optimizer, staging, snapshot)
        else:
            builder = contextlib.nullcontext()
        with builder:
            sharded["optimizer"] = parts.optimizer.sharded_state_dict(
                sharded,
                is_loading=is_loading,
                metadata={
                    "distrib_optim_sharding_type": optim_format,
                    "chained_optim_avoid_prefix": True,
                },
            )
    return sharded


def load_targets(parts: Any, optim_format: str, with_optimizer: bool) -> dict[str, Any]:
    """The sharded state dict a restore loads into (the model's own tensors, and buffers the
    optimizer state is read into). Built before the load needs it, while the step's files are
    still being re-hashed, it is off the restore's critical path."""
    return sharded_training_state(
        parts, optim_format, is_loading=True, with_optimizer=with_optimizer
    )
