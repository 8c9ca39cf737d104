"""The fully-reshardable optimizer state of megatron's DistributedOptimizer, built into staging
buffers.

megatron's ``sharded_param_state_fully_reshardable`` (save side) zero-fills three new
buffer-sized tensors per grad buffer, copies every param's state into a zero-filled DP shard,
gathers into more zero-filled tensors, concatenates, copies again, and hands out views that the
writer then clones: five passes over fresh memory (3.6 s of a 7.6 s save for a 1.5 GiB state).
This builds the same sharded tensors (same keys, shapes, replica ids, values) with one copy per
param into reused buffers (plus a gather into reused buffers when DP > 1). Layouts it does not
reproduce exactly fall back to megatron's own method, so the checkpoint is the same either way.

Load side (:func:`live_fully_reshardable`): megatron's ``is_loading`` path zero-fills the same
world-sized buffers for the load to fill, then copies them into the optimizer state. With one
DP rank every param's state lives whole in the optimizer, so the load targets are views of the
optimizer's own tensors: nothing allocated, and megatron's copy afterwards is a copy of a tensor
onto itself (torch returns early). With more DP ranks each rank holds a range of each param
while the format loads whole params: megatron's path.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from pretrain.platform.compat import fully_reshardable_state_from
from resiliency.checkpoint.write.staging import Stager, StagingPlan, needs_staging, staging_key

log = logging.getLogger(__name__)
PREFIX = "optimizer.state"


def _state_keys(opt: Any) -> tuple[str, ...]:
    # 0.19 names the optimizer's state tensors; 0.16 hard-codes Adam's two.
    return ("param", *getattr(opt, "optimizer_state_keys", ("exp_avg", "exp_avg_sq")))


def unsupported_reason(opt: Any) -> str | None:
    """Why the fast path would not reproduce megatron's output exactly (None: it does)."""
    for gbuf_idx, gbuf_range_maps in enumerate(opt.gbuf_ranges):
        if len(gbuf_range_maps) != 1:
            return "more than one dtype per grad buffer"
        buckets = opt.buffers[gbuf_idx].buckets
        # megatron lays buckets end to end without their tail padding but indexes params in
        # padded coordinates; the two agree only when no bucket before the last is padded.
        if any(b.grad_data.numel() != b.numel_unpadded for b in buckets[:-1]):
            return "padded buckets before the last one"
    dp = opt.data_parallel_group.size()
    if dp > 1 and getattr(opt, "data_parallel_group_gloo", None) is None:
        return "no gloo data-parallel group to gather host buffers over"
    return None


def _fill_local_shards(
    opt: Any, gbuf_range_map: dict[str, Any], shards: dict[str, torch.Tensor]
) -> None:
    for model_param, param_range_map in gbuf_range_map["param_map"].items():
        tensors = opt._get_main_param_and_optimizer_states(model_param)
        local = param_range_map["gbuf_local"]
        for key, shard in shards.items():
            shard[local.start : local.end].copy_(tensors[key].detach().view(-1))


def _gathered_buckets(
    opt: Any,
    gbuf_idx: int,
    bucket_maps: list[dict[str, Any]],
    keys: tuple[str, ...],
    staging: Stager,
) -> list[dict[str, torch.Tensor]]:
    """Per bucket: key -> the whole bucket's state (all DP shards) in a staging buffer."""
    group = opt.data_parallel_group_gloo
    dp, out = group.size(), []
    for bucket_idx, gbuf_range_map in enumerate(bucket_maps):
        world_numel = opt.buffers[gbuf_idx].buckets[bucket_idx].grad_data.numel()
        local_numel = world_numel // dp
        name = f"_gather.{gbuf_idx}.{bucket_idx}"
        shards = {
            k: staging.get(f"{name}.{k}.local", torch.Size([local_numel]), torch.float32)
            for k in keys
        }
        planning = isinstance(staging, StagingPlan)  # a dry run: shapes only, no collectives
        if not planning:
            _fill_local_shards(opt, gbuf_range_map, shards)
        world = {}
        for key, shard in shards.items():
            world[key] = staging.get(
                f"{name}.{key}.world", torch.Size([world_numel]), torch.float32
            )
            if not planning:
                dist.all_gather(list(world[key].chunk(dp)), shard, group=group)
        out.append(world)
    return out


def _in_place(live: torch.Tensor, shape: torch.Size) -> torch.Tensor | None:
    """``live`` reshaped to ``shape`` if the writer can save it as it is: a whole fp32 tensor
    (a view would make torch.save write its entire storage, so megatron clones those)."""
    whole = live.untyped_storage().nbytes() == live.numel() * live.element_size()
    if (
        whole
        and live.is_contiguous()
        and live.dtype == torch.float32
        and live.numel() == shape.numel()
        and not live.is_cuda
    ):
        return live.view(shape)
    return None


def _is_model_param(source: torch.Tensor, sharded: Any, snapshot: bool) -> bool:
    """``source`` (an optimizer tensor, flat) is the memory of the model tensor ``sharded``
    describes, and the save stages that tensor (stage_sharded_state would)."""
    # megatron-core: imported after the CPU shim is applied (pretrain/platform/distributed.py)
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    data = sharded.data
    return (
        type(sharded) is ShardedTensor  # a factory's data is not what it writes
        and data.dtype == source.dtype
        and data.numel() == source.numel()
        and data.is_contiguous()
        and data.data_ptr() == source.data_ptr()
        and needs_staging(data, snapshot)
    )


def build(
    opt: Any,
    model_sharded_state_dict: dict[str, Any],
    staging: Stager,
    snapshot: bool = True,
) -> dict:
    """What ``opt.sharded_param_state_fully_reshardable(sd, is_loading=False)`` returns, with
    every tensor a staging buffer. ``snapshot=False`` (a sync save: training waits for the
    write) leaves whole host tensors of a DP=1 optimizer in place instead of copying them."""
    # megatron-core: imported after the CPU shim is applied (pretrain/platform/distributed.py)
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

    model_tensors, _ = extract_sharded_tensors_and_factories(model_sharded_state_dict)
    metadata_of = {sh.data: sh for sh in nested_values(model_tensors)}
    keys = _state_keys(opt)
    dp = opt.data_parallel_group.size()
    state, param_idx = {}, 0
    for gbuf_idx, gbuf_range_maps in enumerate(opt.gbuf_ranges):
        buffer = opt.buffers[gbuf_idx]
        (bucket_maps,) = gbuf_range_maps.values()
        gathered = _gathered_buckets(opt, gbuf_idx, bucket_maps, keys, staging) if dp > 1 else None
        for model_param, (start, end, bucket_id) in buffer.param_index_map.items():
            sharded = metadata_of[model_param]
            if gathered is None:
                live = opt._get_main_param_and_optimizer_states(model_param)
                sources = {k: live[k].detach().view(-1) for k in keys}
            else:
                bucket_start = buffer.buckets[bucket_id].offset
                sources = {
                    k: gathered[bucket_id][k][start - bucket_start : end - bucket_start]
                    for k in keys
                }
            outputs = {}
            for key, source in sources.items():
                if key == "param" and _is_model_param(source, sharded, snapshot):
                    # fp32 training: the main param is the model param, which the save stages
                    # anyway. Its record and the model's are written from one copy, not two.
                    out = staging.get(staging_key(sharded), sharded.data.shape, source.dtype)
                    out.copy_(sharded.data)  # blocking, as every copy here (GPU to host too)
                    sharded.data = outputs[key] = out
                    continue
                # Gathered state lives in staging buffers reused per bucket: always copy it.
                out = (
                    None
                    if snapshot or gathered is not None
                    else _in_place(source, sharded.data.shape)
                )
                if out is None:
                    out = staging.get(
                        f"{PREFIX}.{key}.{staging_key(sharded)}", sharded.data.shape, torch.float32
                    )
                    out.view(-1).copy_(source)
                outputs[key] = out
            tensors = {key: _state_tensor(sharded, key, data) for key, data in outputs.items()}
            for tensor in tensors.values():
                tensor.validate_metadata_integrity()
            state[param_idx] = tensors
            param_idx += 1
    return state


def build_for_load(opt: Any, model_sharded_state_dict: dict[str, Any]) -> dict | None:
    """What ``opt.sharded_param_state_fully_reshardable(sd, is_loading=True)`` returns, with
    every tensor a view of the optimizer's own state; None where that is not possible."""
    # megatron-core: imported after the CPU shim is applied (pretrain/platform/distributed.py)
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

    # Precision-aware optimizers hand out unscaled copies of their state, not the state.
    if getattr(opt.config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False):
        return None
    if opt.data_parallel_group.size() != 1 or unsupported_reason(opt):
        return None
    model_tensors, _ = extract_sharded_tensors_and_factories(model_sharded_state_dict)
    metadata_of = {sh.data: sh for sh in nested_values(model_tensors)}
    keys = _state_keys(opt)
    state, param_idx = {}, 0
    for gbuf_idx in range(len(opt.gbuf_ranges)):
        for model_param in opt.buffers[gbuf_idx].param_index_map:
            sharded = metadata_of[model_param]
            # With fp32 params the main param is the model param itself: the model's record
            # and the optimizer's "param" record fill the same memory. Both were saved from
            # that one tensor, and a precision change is refused at resume, so they agree.
            live = opt._get_main_param_and_optimizer_states(model_param)
            tensors = {}
            for key in keys:
                target = live.get(key)
                if (
                    target is None
                    or target.dtype != torch.float32
                    or not target.is_contiguous()
                    or target.numel() != sharded.data.numel()
                ):
                    return None
                tensors[key] = _state_tensor(sharded, key, target.detach().view(sharded.data.shape))
            state[param_idx] = tensors
            param_idx += 1
    return state


@contextlib.contextmanager
def live_fully_reshardable(optimizer: Any) -> Iterator[None]:
    """While active, load-side fully-reshardable state of every DistributedOptimizer in
    ``optimizer`` is built by :func:`build_for_load` (megatron's where it returns None)."""
    with contextlib.ExitStack() as stack:
        for opt in _distributed_optimizers(optimizer):
            stack.enter_context(
                fully_reshardable_state_from(
                    opt, build_for_load=lambda sd, _md, opt=opt: build_for_load(opt, sd)
                )
            )
        yield


def _state_tensor(sharded: Any, key: str, data: torch.Tensor) -> Any:
    """The optimizer state ``key`` of the model tensor ``sharded``, as megatron keys it (same
    sharding and replica id), holding ``data``."""
    # megatron-core: imported after the CPU shim is applied (pretrain/platform/distributed.py)
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    kwargs = dict(
        key=f"{PREFIX}.{key}.{sharded.key}",
        data=data,
        dtype=data.dtype,
        replica_id=sharded.replica_id,
    )
    if isinstance(sharded, ShardedTensorFactory):
        kwargs.pop("dtype")
    return replace(sharded, **kwargs)


def _distributed_optimizers(optimizer: Any) -> list[Any]:
    # megatron-core: imported after the CPU shim is applied (pretrain/platform/distributed.py)
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    return [opt for opt in chained if isinstance(opt, DistributedOptimizer)]


@contextlib.contextmanager
def staged_fully_reshardable(
    optimizer: Any, staging: Stager, snapshot: bool = True
) -> Iterator[None]:
    """While active, save-side fully-reshardable state of every DistributedOptimizer in
    ``optimizer`` is built by :func:`build`; loading and unsupported layouts use megatron's."""
    with contextlib.ExitStack() as stack:
        for opt in _distributed_optimizers(optimizer):
            reason = unsupported_reason(opt)
            if reason:
                log.debug("fully_reshardable save: megatron's own path (%s)", reason)
                continue
            stack.enter_context(
                fully_reshardable_state_from(
                    opt, build=functools.partial(_build_for, opt, staging, snapshot)
                )
            )
        yield


def _build_for(
    opt: Any, staging: Stager, snapshot: bool, model_sd: Any, metadata: dict | None
) -> Any:
    return build(opt, model_sd, staging, snapshot)
