"""GPTModel construction: TransformerConfig from our configs, one chunk per virtual stage, DDP."""

from __future__ import annotations

import importlib.util
import logging
import math
import zlib
from typing import Any

import torch
import torch.nn.functional as F

from pretrain.data.vocab import padded_vocab_size  # noqa: F401 - re-exported for the model
from recipes.config.model import ModelConfig
from recipes.config.parallel import ParallelConfig
from recipes.config.perf import PerfConfig

log = logging.getLogger(__name__)


def perf_settings(perf: PerfConfig) -> dict[str, Any]:
    """TransformerConfig fields for recompute and FP8 (megatron-core's names)."""
    settings: dict[str, Any] = {}
    if perf.recompute == "selective":
        settings["recompute_granularity"] = "selective"
    elif perf.recompute == "full":
        settings.update(
            recompute_granularity="full",
            recompute_method=perf.recompute_method,
            recompute_num_layers=perf.recompute_num_layers,
        )
    if perf.fp8 is not None:
        settings.update(fp8=perf.fp8, fp8_recipe=perf.fp8_recipe)
    if perf.tp_comm_overlap:
        settings["tp_comm_overlap"] = True
    return settings


def cuda_extension(name: str) -> bool:
    """Whether a compiled extension module (apex, megatron's fused softmax) is installed."""
    return importlib.util.find_spec(name) is not None


def transformer_config(
    model: ModelConfig,
    par: ParallelConfig,
    device: str,
    bf16: bool,
    perf: PerfConfig,
    deterministic: bool = False,
) -> Any:
    # megatron-core: imported after the CPU shim is applied (pretrain/platform/distributed.py)
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = torch.bfloat16 if bf16 else torch.float32
    on_gpu = device == "cuda"
    moe: dict[str, Any] = {}
    if model.is_moe:
        moe = dict(
            num_moe_experts=model.num_experts,
            moe_router_topk=model.moe_router_topk,
            moe_ffn_hidden_size=model.moe_ffn_hidden_size or model.ffn_hidden_size,
            moe_token_dispatcher_type="alltoall",
            moe_grouped_gemm=False,
            moe_aux_loss_coeff=model.moe_aux_loss_coeff,
            moe_router_load_balancing_type="aux_loss" if model.moe_aux_loss_coeff else "none",
        )
    swiglu = model.activation == "swiglu"
    return TransformerConfig(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        ffn_hidden_size=model.ffn_hidden_size,
        normalization=model.normalization,
        gated_linear_unit=swiglu,
        activation_func=F.silu if swiglu else F.gelu,
        add_bias_linear=model.add_bias_linear,
        hidden_dropout=model.hidden_dropout,
        attention_dropout=model.attention_dropout,
        init_method_std=model.init_method_std,
        tensor_model_parallel_size=par.tp,
        pipeline_model_parallel_size=par.pp,
        virtual_pipeline_model_parallel_size=par.vpp,
        context_parallel_size=par.cp,
        expert_model_parallel_size=par.ep,
        sequence_parallel=par.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=bf16,
        use_cpu_initialization=not on_gpu,
        perform_initialization=model.perform_initialization,
        # Fused kernels: the first two are torch.jit code (any CUDA torch); the masked softmax
        # is a compiled extension (Megatron-LM's or apex's build) and persist_layer_norm is
        # apex's, so without them (a bare torch node) megatron's own unfused paths run
        # (its local norm asserts persist_layer_norm off, and the softmax would ImportError).
        # Without dropout there is nothing to fuse but an add, and the fused kernel (torch.compile
        # on CUDA) draws random numbers for a p=0 mask and is compiled at the first call of each
        # process: a relaunched run's first steps then differ from the uninterrupted run's (the
        # H200 check: bit-identical fresh runs, a restore off by 4e-4 from its first step).
        bias_dropout_fusion=on_gpu and model.hidden_dropout > 0,
        bias_activation_fusion=on_gpu and not swiglu,
        masked_softmax_fusion=on_gpu and cuda_extension("scaled_masked_softmax_cuda"),
        apply_rope_fusion=False,
        persist_layer_norm=on_gpu and cuda_extension("apex"),
        deterministic_mode=deterministic,
        gradient_accumulation_fusion=False,
        # Batched p2p posts send_prev before send_next; with 2 stages both go to the same peer
        # and gloo matches them by order, swapping activations and gradients under VPP.
        batch_p2p_comm=on_gpu,
        **moe,
        **perf_settings(perf),
    )


def layer_spec(model: ModelConfig, use_te: bool) -> Any:
    # megatron-core: imported after the CPU shim is applied (pretrain/platform/distributed.py)
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if use_te:
        return specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=model.num_experts, moe_grouped_gemm=False
        )
    return specs.get_gpt_layer_local_spec(
        num_experts=model.num_experts, moe_grouped_gemm=False, normalization=model.normalization
    )


def build_chunks(
    model: ModelConfig, par: ParallelConfig, tcfg: Any, vocab: int, use_te: bool
) -> list[torch.nn.Module]:
    """One GPTModel per virtual pipeline stage held by this rank."""
    # megatron-core: imported after the CPU shim is applied (pretrain/platform/distributed.py)
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_model import GPTModel

    spec = layer_spec(model, use_te)
    chunks = []
    for vp in range(par.vpp or 1):
        stage = vp if par.vpp else None
        chunks.append(
            GPTModel(
                config=tcfg,
                transformer_layer_spec=spec,
                vocab_size=vocab,
                max_sequence_length=model.max_position_embeddings or model.seq_length,
                pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
                post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
                share_embeddings_and_output_weights=model.share_embeddings_and_output_weights,
                position_embedding_type=model.position_embedding_type,
                rotary_base=model.rotary_base,
                vp_stage=stage,
            )
        )
    return chunks


def layout_invariant_init(chunks: list[torch.nn.Module], model: ModelConfig, seed: int) -> None:
    """Draw each weight from (seed, its global checkpoint key) and keep this rank's slice.

    Megatron's own init depends on which rank builds which layer, so TP/PP layouts start from
    different weights. Keys in the sharded state dict are layout-free (global layer numbers,
    global shapes and offsets), which makes every layout start from the same model.
    """
    # megatron-core: imported after the CPU shim is applied (pretrain/platform/distributed.py)
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    out_std = model.init_method_std / math.sqrt(2.0 * model.num_layers)
    with torch.no_grad():
        for chunk in chunks:
            for sharded in nested_values(chunk.sharded_state_dict()):
                if not isinstance(sharded, ShardedTensor) or not _is_random_weight(sharded.key):
                    continue
                std = out_std if _is_output_projection(sharded.key) else model.init_method_std
                generator = torch.Generator().manual_seed(
                    seed * 1_000_003 + zlib.crc32(sharded.key.encode())
                )
                full = torch.randn(sharded.global_shape, generator=generator) * std
                index = tuple(
                    slice(off, off + size)
                    for off, size in zip(
                        sharded.global_offset,
                        (1,) * sharded.prepend_axis_num + tuple(sharded.local_shape),
                    )
                )
                sharded.data.copy_(full[index].reshape(sharded.data.shape))


def _is_random_weight(key: str) -> bool:
    return key.endswith("weight") and "norm" not in key.split(".")[-2]


def _is_output_projection(key: str) -> bool:
    return "linear_proj" in key or "linear_fc2" in key


def wrap_ddp(
    chunks: list[torch.nn.Module],
    tcfg: Any,
    use_distributed_optimizer: bool,
    bf16: bool,
    perf: PerfConfig,
    check_for_nan_in_grad: bool = True,
) -> list[Any]:
    # megatron-core: imported after the CPU shim is applied (pretrain/platform/distributed.py)
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=perf.overlap_grad_reduce,
        overlap_param_gather=perf.overlap_param_gather,
        use_distributed_optimizer=use_distributed_optimizer,
        check_for_nan_in_grad=check_for_nan_in_grad,
    )
    wrapped = []
    for index, chunk in enumerate(chunks):
        module = Float16Module(tcfg, chunk) if bf16 else chunk
        # Only the first chunk gets bucketing, as in Megatron-LM (overlap needs one bucket order).
        wrapped.append(
            DistributedDataParallel(
                config=tcfg, ddp_config=ddp_config, module=module, disable_bucketing=index > 0
            )
        )
    return wrapped


def count_parameters(chunks: list[torch.nn.Module]) -> int:
    return sum(p.numel() for chunk in chunks for p in chunk.parameters())
