"""The model: architecture, sizes, initialisation (``model.*``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from recipes.checks import one_of, positive, require


@dataclass(kw_only=True)
class ModelConfig:
    name: str = "gpt"  # model family name; new runs are named <name>-<launch id>
    num_layers: int = 4  # transformer layers
    hidden_size: int = 64  # model width
    num_attention_heads: int = 4  # query heads per layer
    num_query_groups: Optional[int] = None  # key/value heads (GQA); None: one per query head (MHA)
    ffn_hidden_size: Optional[int] = None  # MLP width; None: 4 x hidden_size
    seq_length: int = 64  # tokens per sample
    max_position_embeddings: Optional[int] = None  # None: seq_length
    # Padded vocab size; None = Megatron's rule (multiple of make_vocab_size_divisible_by * tp).
    # Fix it to keep logits identical across TP sizes (parallelism equivalence, resharding).
    padded_vocab_size: Optional[int] = None
    make_vocab_size_divisible_by: int = 128  # vocab padding multiple (times TP), as Megatron-LM
    position_embedding_type: str = "rope"  # rope | learned_absolute
    rotary_base: int = 10000  # RoPE theta
    normalization: str = "LayerNorm"  # LayerNorm | RMSNorm
    activation: str = "gelu"  # gelu | swiglu
    add_bias_linear: bool = True  # biases in linear layers (off for Llama-style models)
    # tie the input embedding and the output projection
    share_embeddings_and_output_weights: bool = True
    hidden_dropout: float = 0.0  # dropout after attention and MLP
    attention_dropout: float = 0.0  # dropout on attention probabilities
    init_method_std: float = 0.02  # std of the normal weight init
    # Initialise every weight from (seed, global parameter name) so any TP/PP/DP layout starts
    # from identical weights. Costs a full-tensor RNG draw per shard: meant for small models.
    layout_invariant_init: bool = False
    # false: allocate the weights without drawing them (megatron's perform_initialization).
    # The checkpoint hook sets it when it will restore a step, whose weights replace every
    # parameter anyway (0.5 s of a 1.5 GiB model's restart here); without a step to restore
    # it is refused.
    perform_initialization: bool = True
    num_experts: Optional[int] = None  # MoE experts per MLP; None: dense
    moe_router_topk: int = 2  # experts each token is routed to
    moe_ffn_hidden_size: Optional[int] = None  # expert MLP width; None: ffn_hidden_size
    moe_aux_loss_coeff: float = 0.0  # load-balancing loss weight

    def __post_init__(self) -> None:
        positive(
            "model",
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            seq_length=self.seq_length,
            num_query_groups=self.num_query_groups,
            ffn_hidden_size=self.ffn_hidden_size,
            num_experts=self.num_experts,
            moe_router_topk=self.moe_router_topk,
            padded_vocab_size=self.padded_vocab_size,
        )
        require(
            self.hidden_size % self.num_attention_heads == 0,
            f"model.hidden_size={self.hidden_size} must be divisible by "
            f"model.num_attention_heads={self.num_attention_heads}",
        )
        groups = self.num_query_groups or self.num_attention_heads
        require(
            self.num_attention_heads % groups == 0,
            f"model.num_attention_heads={self.num_attention_heads} must be divisible by "
            f"model.num_query_groups={groups}",
        )
        one_of(
            "model",
            "position_embedding_type",
            self.position_embedding_type,
            ("rope", "learned_absolute"),
        )
        one_of("model", "normalization", self.normalization, ("LayerNorm", "RMSNorm"))
        one_of("model", "activation", self.activation, ("gelu", "swiglu"))
        if self.num_experts is not None:
            require(
                self.moe_router_topk <= self.num_experts,
                f"model.moe_router_topk={self.moe_router_topk} exceeds "
                f"model.num_experts={self.num_experts}",
            )
        for key in ("hidden_dropout", "attention_dropout"):
            value = getattr(self, key)
            require(0.0 <= value < 1.0, f"model.{key} must be in [0, 1), got {value}")

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None
