"""FLOPs per step against hand-counted GEMMs for published configurations."""

from __future__ import annotations

import pytest

from pretrain.model.flops import flops_per_step, peak_tflops
from recipes.config.model import ModelConfig


def _by_gemm(
    h: int,
    s: int,
    layers: int,
    heads: int,
    groups: int,
    ffn: int,
    vocab: int,
    mlp_mats: int,
    routed: int,
) -> float:
    """Forward FLOPs per sequence, one GEMM at a time (2 per multiply-add), times 3."""
    d = h // heads
    per_token_layer = (
        2 * h * (heads * d)  # q
        + 2 * 2 * h * (groups * d)  # k and v
        + 2 * (heads * d) * h  # attention output
        + 2 * 2 * s * heads * d  # scores and weighted values, full sequence
        + routed * mlp_mats * 2 * h * ffn  # up (+ gate) and down of each routed expert
    )
    return 3 * s * (layers * per_token_layer + 2 * h * vocab)


def test_llama3_8b_matches_a_gemm_count() -> None:
    model = ModelConfig(
        num_layers=32,
        hidden_size=4096,
        num_attention_heads=32,
        num_query_groups=8,
        ffn_hidden_size=14336,
        seq_length=8192,
        activation="swiglu",
    )
    expected = _by_gemm(4096, 8192, 32, 32, 8, 14336, 128256, mlp_mats=3, routed=1)
    assert flops_per_step(model, 1, 128256) == pytest.approx(expected, rel=1e-12)
    # ~6 x 7.5e9 non-embedding parameters + 12 L s h of attention, per token
    assert expected / 8192 == pytest.approx(6 * 7.5e9 + 12 * 32 * 8192 * 4096, rel=0.01)


def test_mixtral_8x7b_counts_the_top2_experts_only() -> None:
    model = ModelConfig(
        num_layers=32,
        hidden_size=4096,
        num_attention_heads=32,
        num_query_groups=8,
        ffn_hidden_size=14336,
        seq_length=4096,
        activation="swiglu",
        num_experts=8,
        moe_router_topk=2,
        moe_ffn_hidden_size=14336,
    )
    expected = _by_gemm(4096, 4096, 32, 32, 8, 14336, 32000, mlp_mats=3, routed=2)
    assert flops_per_step(model, 4, 32000) == pytest.approx(4 * expected, rel=1e-12)


def test_gpt_gelu_without_gqa() -> None:
    model = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32)
    expected = _by_gemm(64, 32, 2, 4, 4, 256, 384, mlp_mats=2, routed=1)
    assert flops_per_step(model, 8, 384) == pytest.approx(8 * expected, rel=1e-12)


def test_peaks_are_known_for_datacenter_gpus_only() -> None:
    assert peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == 989.0
    assert peak_tflops("NVIDIA H200", "fp8") == 1979.0
    assert peak_tflops("NVIDIA A100-SXM4-80GB", "fp8") is None
    assert peak_tflops("cpu", "bf16") is None
