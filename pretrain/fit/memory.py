"""Memory per GPU of a recipe at its real layout, from the parameters each rank holds.

Per rank of each pipeline stage (``meta_model.StageParams``):

- weights in the training dtype; gradients in fp32 (megatron DDP's ``grad_reduce_in_fp32``);
- the optimizer: Adam's two fp32 moments plus, for bf16 weights, an fp32 main copy; with the
  distributed optimizer sharded over the data-parallel ranks (DP x CP for dense parameters,
  the expert-data-parallel ranks for expert parameters);
- activations, from Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
  Transformer Models", Table 2) as Megatron-LM's theoretical memory report generalises it to
  any FFN size: per layer and micro-batch ``s*b*h*(18 + 4*ffn/h)/t`` bytes with sequence
  parallelism, ``s*b*h*(10 + (8 + 4*ffn/h)/t)`` without it, with the attention scores never
  stored (Transformer Engine's fused attention; selective recomputation drops them elsewhere)
  and ``2*s*b*h`` (the layer input, /t with SP) under full recomputation; ``s`` is the sequence
  each CP rank holds. Stage ``i`` of a 1F1B schedule holds ``min(microbatches, pp - i)``
  micro-batches in flight; the interleaved schedule multiplies that by
  ``1 + (pp - 1) / (pp * vpp)``. The first stage adds the token ids and embedding dropout
  masks, the last the fp32 logits of one micro-batch;
- a fixed allowance for the CUDA context and communication buffers (``RUNTIME_GIB``).

What is not counted: allocator fragmentation (the headroom covers it), Transformer Engine's
FP8 weight copies and workspaces, and MoE token-imbalance spikes.
"""

from __future__ import annotations

from dataclasses import dataclass

from pretrain.fit.meta_model import StageParams
from recipes import RunConfig
from recipes.gpus import gpu_bytes  # noqa: F401 - the planners' import of it

GIB = 1 << 30
MIB = 1 << 20
RUNTIME_GIB = 2.0  # CUDA context, NCCL and cuBLAS workspaces: an allowance, not a measurement
DEFAULT_HEADROOM = 0.10  # of the GPU's memory, left for fragmentation and spikes


@dataclass(frozen=True)
class StageMemory:
    pp_rank: int
    weights: float
    grads: float
    optimizer: float
    activations: float
    runtime: float = RUNTIME_GIB * GIB

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations + self.runtime


def _bf16(run: RunConfig) -> bool:
    return run.train.precision != "fp32"  # "auto" trains in bf16 on a GPU


def expert_dp(run: RunConfig) -> int:
    """Ranks an expert parameter is replicated on (its optimizer shards over them)."""
    par = run.parallel
    return run.launch.world_size // (par.pp * par.ep * par.tp)


def optimizer_bytes(run: RunConfig, stage: StageParams) -> float:
    per_param = 8 + (4 if _bf16(run) else 0)  # Adam moments, and the fp32 main copy of bf16
    dense, experts = stage.local_total - stage.expert_local, stage.expert_local
    if not run.optimizer.use_distributed_optimizer:
        return per_param * (dense + experts)
    par = run.parallel
    dense_shards = par.data_parallel_size(run.launch.world_size) * par.cp
    return per_param * (dense / dense_shards + experts / expert_dp(run))


def microbatches(run: RunConfig) -> int:
    dp = run.parallel.data_parallel_size(run.launch.world_size)
    return run.train.global_batch_size // (run.train.micro_batch_size * dp)


def in_flight(run: RunConfig, pp_rank: int) -> float:
    """Micro-batches whose activations stage ``pp_rank`` holds at its peak."""
    par = run.parallel
    held = min(microbatches(run), par.pp - pp_rank)
    if par.vpp:
        held *= 1 + (par.pp - 1) / (par.pp * par.vpp)
    return held


def layer_activation_bytes(run: RunConfig) -> float:
    """One transformer layer, one micro-batch, on one rank."""
    model, par = run.model, run.parallel
    s, b, h, t = model.seq_length / par.cp, run.train.micro_batch_size, model.hidden_size, par.tp
    ffn = model.ffn_hidden_size or 4 * h
    if model.num_experts:  # each token passes through top-k experts
        ffn = (model.moe_ffn_hidden_size or ffn) * model.moe_router_topk
    sp = par.sequence_parallel and t > 1
    if run.perf.recompute == "full":
        return 2 * s * b * h / (t if sp else 1)
    if sp:
        return s * b * h * (18 + 4 * ffn / h) / t
    return s * b * h * (10 + (8 + 4 * ffn / h) / t)


def activation_bytes(run: RunConfig, stage: StageParams, padded_vocab: int) -> float:
    model, par = run.model, run.parallel
    s, b, h, t = model.seq_length / par.cp, run.train.micro_batch_size, model.hidden_size, par.tp
    held = in_flight(run, stage.pp_rank)
    total = layer_activation_bytes(run) * stage.layers * held
    if stage.pp_rank == 0:  # token ids (int64) and the embedding's dropout mask
        total += (8 * s * b + s * b * h) * held / t
    if stage.pp_rank == par.pp - 1:  # fp32 logits and the output layer's input
        total += 4 * s * b * (h + padded_vocab) / t
    return total


def stage_memory(run: RunConfig, stage: StageParams, padded_vocab: int) -> StageMemory:
    weight_bytes = 2 if _bf16(run) else 4
    return StageMemory(
        pp_rank=stage.pp_rank,
        weights=weight_bytes * stage.local_total,
        grads=4 * stage.local_total,
        optimizer=optimizer_bytes(run, stage),
        activations=activation_bytes(run, stage, padded_vocab),
    )
