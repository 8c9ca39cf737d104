"""megatron-core GPT weights <-> Hugging Face ``transformers`` weights and config.

Three transformers families cover the models this project trains: Llama (RMSNorm, SwiGLU, RoPE,
GQA), Mixtral (the same with top-k routed SwiGLU experts) and GPT-NeoX (LayerNorm, GELU, RoPE,
biases: the GPT of ``gpt_tiny``). Megatron's checkpoint keys are global: every per-layer tensor
stacks the layers on a leading axis whatever the layout that saved it, so conversion needs no
world size. Hand-written rather than Megatron-Bridge's AutoBridge: Bridge needs a GPU stack
(Transformer Engine) and its own model providers; these mappings are a few dozen lines, and the
tests hold them to logits equality against transformers itself.
"""

from __future__ import annotations

from typing import Any

import torch

from recipes import ConfigError
from recipes.config.model import ModelConfig

LAYERS = "decoder.layers."
EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT = "output_layer.weight"
# megatron's names of the same tensors under the TE spec (fused) and the local spec (separate).
_ALIASES = {
    "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
    "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
}
_NORM_EPS = 1e-5  # megatron-core's layernorm_epsilon default, used by every recipe here


def hf_family(model: ModelConfig) -> str:
    """The transformers family that computes exactly what ``model`` computes, or ConfigError."""
    if model.position_embedding_type != "rope":
        raise ConfigError(
            f"export to transformers supports RoPE models; model.position_embedding_type="
            f"{model.position_embedding_type!r} has no matching family here"
        )
    llama_like = model.normalization == "RMSNorm" and model.activation == "swiglu"
    if model.is_moe:
        if not llama_like or model.add_bias_linear:
            raise ConfigError(
                "export of a MoE model needs the Mixtral form: model.normalization=RMSNorm, "
                "model.activation=swiglu, model.add_bias_linear=false"
            )
        return "mixtral"
    if llama_like:
        return "llama"
    if model.normalization == "LayerNorm" and model.activation == "gelu":
        if _groups(model) != model.num_attention_heads:
            raise ConfigError("export of a LayerNorm/GELU model (GPT-NeoX) needs MHA, not GQA")
        return "gpt_neox"
    raise ConfigError(
        f"no transformers family for normalization={model.normalization} with "
        f"activation={model.activation}: export supports RMSNorm+swiglu (Llama, Mixtral) and "
        "LayerNorm+gelu (GPT-NeoX)"
    )


def _groups(model: ModelConfig) -> int:
    return model.num_query_groups or model.num_attention_heads


def _ffn(model: ModelConfig) -> int:
    return model.ffn_hidden_size or 4 * model.hidden_size


def hf_config(model: ModelConfig, vocab_size: int, dtype: torch.dtype, eod: int | None) -> dict:
    """config.json for ``model`` with ``vocab_size`` real (unpadded) token ids."""
    family = hf_family(model)
    common: dict[str, Any] = {
        "model_type": family,
        "vocab_size": vocab_size,
        "hidden_size": model.hidden_size,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_attention_heads,
        "max_position_embeddings": model.max_position_embeddings or model.seq_length,
        "tie_word_embeddings": model.share_embeddings_and_output_weights,
        "attention_dropout": 0.0,
        "initializer_range": model.init_method_std,
        "dtype": str(dtype).removeprefix("torch."),
        "bos_token_id": None,
        "eos_token_id": eod,
        "use_cache": True,
    }
    # rope_parameters for transformers 5, rope_theta for 4.x (each ignores the other's key)
    rope = {"rope_type": "default", "rope_theta": float(model.rotary_base)}
    if family == "gpt_neox":
        return {
            **common,
            "architectures": ["GPTNeoXForCausalLM"],
            "intermediate_size": _ffn(model),
            "hidden_act": "gelu",
            "layer_norm_eps": _NORM_EPS,
            "use_parallel_residual": False,
            "attention_bias": True,  # biases written as zeros when the model has none
            "hidden_dropout": 0.0,
            "rotary_pct": 1.0,
            "rotary_emb_base": model.rotary_base,
            "rope_parameters": {**rope, "partial_rotary_factor": 1.0},
        }
    llama = {
        **common,
        "num_key_value_heads": _groups(model),
        "head_dim": model.hidden_size // model.num_attention_heads,
        "hidden_act": "silu",
        "rms_norm_eps": _NORM_EPS,
        "rope_theta": float(model.rotary_base),
        "rope_parameters": rope,
    }
    if family == "mixtral":
        return {
            **llama,
            "architectures": ["MixtralForCausalLM"],
            "intermediate_size": model.moe_ffn_hidden_size or _ffn(model),
            "num_local_experts": model.num_experts,
            "num_experts_per_tok": model.moe_router_topk,
            "router_aux_loss_coef": model.moe_aux_loss_coeff,
            "output_router_logits": False,
            "sliding_window": None,
        }
    return {
        **llama,
        "architectures": ["LlamaForCausalLM"],
        "intermediate_size": _ffn(model),
        "attention_bias": model.add_bias_linear,
        "mlp_bias": model.add_bias_linear,
    }


def model_fields_from_hf(config: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields a transformers config.json fixes (to check a recipe against)."""
    family = config.get("model_type")
    if family not in ("llama", "mixtral", "gpt_neox"):
        raise ConfigError(
            f"import supports transformers model_type llama, mixtral and gpt_neox, not {family!r}"
        )
    heads = config["num_attention_heads"]
    rope = config.get("rope_parameters") or {}
    theta = rope.get("rope_theta", config.get("rope_theta", config.get("rotary_emb_base", 1e4)))
    fields: dict[str, Any] = {
        "num_layers": config["num_hidden_layers"],
        "hidden_size": config["hidden_size"],
        "num_attention_heads": heads,
        "position_embedding_type": "rope",
        "rotary_base": int(theta),
        "share_embeddings_and_output_weights": bool(config.get("tie_word_embeddings", False)),
    }
    if family == "gpt_neox":
        return {
            **fields,
            "normalization": "LayerNorm",
            "activation": "gelu",
            "ffn_hidden_size": config["intermediate_size"],
            "add_bias_linear": True,
        }
    kv = config.get("num_key_value_heads") or heads
    fields.update(normalization="RMSNorm", activation="swiglu", num_query_groups=kv)
    if family == "mixtral":
        return {
            **fields,
            "add_bias_linear": False,
            "num_experts": config["num_local_experts"],
            "moe_router_topk": config["num_experts_per_tok"],
            "moe_ffn_hidden_size": config["intermediate_size"],
        }
    return {
        **fields,
        "ffn_hidden_size": config["intermediate_size"],
        "add_bias_linear": bool(config.get("attention_bias", False)),
    }


def normalised_keys(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same tensors under the TE spec's names (a local-spec MoE layer saves its norms
    under their own module names)."""
    out = {}
    for key, value in tensors.items():
        for old, new in _ALIASES.items():
            key = key.replace(LAYERS + old, LAYERS + new)
        out[key] = value
    return out


def split_qkv(
    qkv: torch.Tensor, heads: int, groups: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """megatron's fused QKV rows (per query group: its queries, then one key, one value head)
    -> separate q, k, v rows."""
    per_group = heads // groups
    rest = qkv.shape[1:]
    grouped = qkv.reshape(groups, per_group + 2, -1, *rest)
    head_dim = grouped.shape[2]
    q = grouped[:, :per_group].reshape(heads * head_dim, *rest)
    k = grouped[:, per_group].reshape(groups * head_dim, *rest)
    v = grouped[:, per_group + 1].reshape(groups * head_dim, *rest)
    return q, k, v


def join_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, groups: int
) -> torch.Tensor:
    """Inverse of :func:`split_qkv`."""
    per_group, rest = heads // groups, q.shape[1:]
    head_dim = q.shape[0] // heads
    q = q.reshape(groups, per_group, head_dim, *rest)
    k = k.reshape(groups, 1, head_dim, *rest)
    v = v.reshape(groups, 1, head_dim, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


# Per-layer tensors that only change their name (megatron -> transformers), per family.
_LLAMA_RENAMES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.linear_proj.bias": "self_attn.o_proj.bias",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "mlp.linear_fc2.bias": "mlp.down_proj.bias",
}
_MIXTRAL_RENAMES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "mlp.router.weight": "block_sparse_moe.gate.weight",
}
_NEOX_RENAMES = {
    f"{mc}.{suffix}": f"{hf}.{suffix}"
    for mc, hf in (
        ("self_attention.linear_qkv", "attention.query_key_value"),
        ("self_attention.linear_proj", "attention.dense"),
        ("mlp.linear_fc1", "mlp.dense_h_to_4h"),
        ("mlp.linear_fc2", "mlp.dense_4h_to_h"),
    )
    for suffix in ("weight", "bias")
} | {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "post_attention_layernorm.bias",
}
RENAMES = {"llama": _LLAMA_RENAMES, "mixtral": _MIXTRAL_RENAMES, "gpt_neox": _NEOX_RENAMES}
# transformers 5 keeps Mixtral's experts fused in memory; its own saves use the hub names below.
_QKV, _FC1, _FC2 = "self_attention.linear_qkv", "mlp.linear_fc1", "mlp.linear_fc2"
_EXPERTS = "mlp.experts.experts."


def _top_names(family: str) -> tuple[str, str, str, str]:
    """(prefix, embedding, output, final norm) in transformers' names."""
    if family == "gpt_neox":
        return "gpt_neox.", "gpt_neox.embed_in.weight", "embed_out.weight", "final_layer_norm"
    return "model.", "model.embed_tokens.weight", "lm_head.weight", "norm"


def _layer_to_hf(family: str, layer: dict[str, torch.Tensor], model: ModelConfig) -> dict:
    heads, groups = model.num_attention_heads, _groups(model)
    out = {RENAMES[family][k]: v for k, v in layer.items() if k in RENAMES[family]}
    if family == "gpt_neox":
        # GPT-NeoX always has biases: a bias-free model's are zeros, the same function.
        for name in (
            "attention.query_key_value",
            "attention.dense",
            "mlp.dense_h_to_4h",
            "mlp.dense_4h_to_h",
        ):
            weight = out[f"{name}.weight"]
            out.setdefault(f"{name}.bias", torch.zeros(weight.shape[0], dtype=weight.dtype))
        return out
    for suffix in ("weight", "bias"):
        if f"{_QKV}.{suffix}" in layer:
            q, k, v = split_qkv(layer[f"{_QKV}.{suffix}"], heads, groups)
            out |= {f"self_attn.{n}_proj.{suffix}": t for n, t in zip("qkv", (q, k, v))}
        if family == "llama" and f"{_FC1}.{suffix}" in layer:
            gate, up = layer[f"{_FC1}.{suffix}"].chunk(2, dim=0)
            out |= {f"mlp.gate_proj.{suffix}": gate, f"mlp.up_proj.{suffix}": up}
    if family == "mixtral":
        fc1, fc2 = layer[_EXPERTS + "linear_fc1.weight"], layer[_EXPERTS + "linear_fc2.weight"]
        for j in range(fc1.shape[0]):
            gate, up = fc1[j].chunk(2, dim=0)
            expert = f"block_sparse_moe.experts.{j}."
            out |= {expert + "w1.weight": gate, expert + "w3.weight": up}
            out[expert + "w2.weight"] = fc2[j]
    return out


def to_hf(
    tensors: dict[str, torch.Tensor], model: ModelConfig, vocab_size: int
) -> dict[str, torch.Tensor]:
    """transformers' state dict from megatron's global model tensors; padded vocab rows are
    dropped (the ids past the tokenizer's vocabulary were never trained)."""
    family = hf_family(model)
    t = normalised_keys(tensors)
    prefix, embed, output, norm = _top_names(family)
    out = {embed: t[EMBEDDING][:vocab_size]}
    if not model.share_embeddings_and_output_weights:
        out[output] = t[OUTPUT][:vocab_size]
    for suffix in ("weight", "bias"):
        if f"decoder.final_layernorm.{suffix}" in t:
            out[f"{prefix}{norm}.{suffix}"] = t[f"decoder.final_layernorm.{suffix}"]
    stacked = {k.removeprefix(LAYERS): v for k, v in t.items() if k.startswith(LAYERS)}
    for i in range(model.num_layers):
        layer = {name: value[i] for name, value in stacked.items()}
        for name, value in _layer_to_hf(family, layer, model).items():
            out[f"{prefix}layers.{i}.{name}"] = value
    return {k: v.contiguous() for k, v in out.items()}


def _layer_from_hf(family: str, layer: dict[str, torch.Tensor], model: ModelConfig) -> dict:
    heads, groups = model.num_attention_heads, _groups(model)
    out = {mc: layer[hf] for mc, hf in RENAMES[family].items() if hf in layer}
    if family == "gpt_neox":
        return out
    for suffix in ("weight", "bias"):
        if f"self_attn.q_proj.{suffix}" in layer:
            q, k, v = (layer[f"self_attn.{n}_proj.{suffix}"] for n in "qkv")
            out[f"{_QKV}.{suffix}"] = join_qkv(q, k, v, heads, groups)
        if f"mlp.gate_proj.{suffix}" in layer:
            gate, up = layer[f"mlp.gate_proj.{suffix}"], layer[f"mlp.up_proj.{suffix}"]
            out[f"{_FC1}.{suffix}"] = torch.cat([gate, up])
    if family == "mixtral":
        out |= _experts_from_hf(layer, model.num_experts or 0)
    return out


def _experts_from_hf(layer: dict[str, torch.Tensor], experts: int) -> dict[str, torch.Tensor]:
    if "mlp.experts.gate_up_proj" in layer:  # transformers 5's in-memory names
        gate_up, down = layer["mlp.experts.gate_up_proj"], layer["mlp.experts.down_proj"]
        return {_EXPERTS + "linear_fc1.weight": gate_up, _EXPERTS + "linear_fc2.weight": down}
    expert = "block_sparse_moe.experts.{}.{}.weight".format
    fc1 = [torch.cat([layer[expert(j, "w1")], layer[expert(j, "w3")]]) for j in range(experts)]
    fc2 = [layer[expert(j, "w2")] for j in range(experts)]
    return {
        _EXPERTS + "linear_fc1.weight": torch.stack(fc1),
        _EXPERTS + "linear_fc2.weight": torch.stack(fc2),
    }


def from_hf(
    hf: dict[str, torch.Tensor], model: ModelConfig, padded_vocab: int
) -> dict[str, torch.Tensor]:
    """megatron's global model tensors from transformers' state dict; the vocabulary is padded
    to ``padded_vocab`` rows with zeros."""
    family = hf_family(model)
    prefix, embed, output, norm = _top_names(family)
    hf = {k.replace(".mlp.gate.", ".block_sparse_moe.gate."): v for k, v in hf.items()}

    def padded(rows: torch.Tensor) -> torch.Tensor:
        extra = rows.new_zeros(padded_vocab - rows.shape[0], *rows.shape[1:])
        return torch.cat([rows, extra])

    out = {EMBEDDING: padded(hf[embed])}
    if not model.share_embeddings_and_output_weights:
        out[OUTPUT] = padded(hf[output])
    for suffix in ("weight", "bias"):
        if f"{prefix}{norm}.{suffix}" in hf:
            out[f"decoder.final_layernorm.{suffix}"] = hf[f"{prefix}{norm}.{suffix}"]
    layers = []
    for i in range(model.num_layers):
        start = f"{prefix}layers.{i}."
        layer = {k.removeprefix(start): v for k, v in hf.items() if k.startswith(start)}
        layers.append(_layer_from_hf(family, layer, model))
    for name in layers[0]:
        out[LAYERS + name] = torch.stack([layer[name] for layer in layers])
    return out
