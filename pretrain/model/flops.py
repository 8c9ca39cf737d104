"""Model FLOPs per step, TFLOP/s per device and MFU, as Megatron-LM reports them.

The count is Megatron-LM's ``num_floating_point_operations`` (training.py): every GEMM three
times (forward, weight gradient, data gradient), two FLOPs per multiply-add, attention scores
over the full (not causal-halved) sequence, GQA key/value projections, SwiGLU's third matrix,
the top-k routed experts of an MoE layer, and the vocabulary projection. Recompute is not
counted (model FLOPs, not hardware FLOPs), so MFU compares across recompute settings.
"""

from __future__ import annotations

from recipes.config.model import ModelConfig
from recipes.gpus import device_peak_tflops


def flops_per_step(model: ModelConfig, global_batch_size: int, padded_vocab: int) -> float:
    """Model FLOPs of one training step (forward and backward) over the global batch."""
    h, s, layers = model.hidden_size, model.seq_length, model.num_layers
    heads = model.num_attention_heads
    groups = model.num_query_groups or heads
    kv_channels = h // heads
    query_ratio = kv_channels * heads / h
    glu = 1.5 if model.activation == "swiglu" else 1.0
    ffn = model.ffn_hidden_size or 4 * h
    routed = 1
    if model.num_experts:
        ffn, routed = model.moe_ffn_hidden_size or ffn, model.moe_router_topk
    # 12 = 3 (fwd, wgrad, dgrad) x 2 (two GEMMs per block) x 2 (FLOPs per multiply-add)
    return (
        12
        * global_batch_size
        * s
        * layers
        * h
        * h
        * (
            (1 + groups / heads + s / h) * query_ratio  # attention
            + (ffn / h) * routed * glu  # MLP (routed experts)
            + padded_vocab / (2 * layers * h)  # logits
        )
    )


def peak_tflops(device_name: str, precision: str) -> float | None:
    """The device's dense peak for ``precision`` (bf16 | fp8), None when unknown (e.g. CPU)."""
    return device_peak_tflops(device_name, precision)
