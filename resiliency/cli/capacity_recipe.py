"""What ``plan`` takes from a recipe: parameter count, step time, retention and save interval.

The parameter count is megatron-core GPTModel's, from the model config alone (no model is
built): embeddings, per layer two norms, QKV (with GQA) and output projections, the MLP (SwiGLU's
extra matrix, or a router plus every expert of an MoE layer), the final norm and an untied
output layer. The step time is an estimate: Megatron-LM's model FLOPs per step (pretrain/flops.py)
over world size x peak TFLOP/s x an assumed MFU; measure it, then pass ``--step-time``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pretrain.flops import PEAK_TFLOPS, flops_per_step, peak_tflops
from recipes import RunConfig, load_config
from recipes.schema import ModelConfig

DEFAULT_MFU = 0.40  # what large Megatron-LM pretraining runs report on H100 (35-45 %)


@dataclass(frozen=True)
class StepTime:
    seconds: float | None  # None: not enough to estimate it
    detail: str  # where it came from, or what is missing


@dataclass(frozen=True)
class RecipeFacts:
    name: str
    params: int | None  # None: the vocabulary size is unknown
    padded_vocab: int | None
    vocab_detail: str  # where the vocabulary size came from, or why it is unknown
    keep_last: int
    save_interval: int | None
    dtype: str
    run: RunConfig


def model_parameters(model: ModelConfig, padded_vocab: int) -> int:
    """Parameters of megatron-core's GPTModel for ``model`` (all ranks together)."""
    h, heads = model.hidden_size, model.num_attention_heads
    groups = model.num_query_groups or heads
    kv = h // heads
    bias = model.add_bias_linear
    norm = 2 * h if model.normalization == "LayerNorm" else h  # LayerNorm has a bias
    qkv = kv * (heads + 2 * groups)
    attention = h * qkv + heads * kv * h + ((qkv + h) if bias else 0)
    glu = 2 if model.activation == "swiglu" else 1  # SwiGLU: gate and up in one fc1

    def mlp(ffn: int) -> int:
        return h * ffn * glu + ffn * h + ((ffn * glu + h) if bias else 0)

    ffn = model.ffn_hidden_size or 4 * h
    if model.num_experts:
        expert_ffn = model.moe_ffn_hidden_size or ffn
        mlp_params = h * model.num_experts + model.num_experts * mlp(expert_ffn)  # + router
    else:
        mlp_params = mlp(ffn)
    embedding = padded_vocab * h
    if model.position_embedding_type == "learned_absolute":
        embedding += (model.max_position_embeddings or model.seq_length) * h
    output = 0 if model.share_embeddings_and_output_weights else padded_vocab * h
    return embedding + model.num_layers * (2 * norm + attention + mlp_params) + norm + output


def padded_vocab(run: RunConfig, vocab: int | None) -> tuple[int | None, str]:
    """Padded vocabulary: the model's pinned size, ``--vocab`` padded as Megatron pads, or the
    recipe's tokenizer (local files only); None with the reason when none of them is there."""
    from pretrain.model import padded_vocab_size  # torch: only for recipe plans
    from pretrain.tokenizer import build_tokenizer

    if vocab is not None:
        padded = padded_vocab_size(run.model, vocab, run.parallel.tp)
        return padded, f"padded vocab {padded} (--vocab {vocab})"
    if (pinned := run.model.padded_vocab_size) is not None:
        return pinned, f"padded vocab {pinned} (model.padded_vocab_size)"
    if (known := run.data.vocab_size) is not None:
        padded = padded_vocab_size(run.model, known, run.parallel.tp)
        return padded, f"padded vocab {padded} (data.vocab_size {known})"
    try:
        size = build_tokenizer(run.data.tokenizer, run.data.tokenizer_path).vocab_size
    except (ValueError, OSError, ImportError) as exc:
        return None, f"tokenizer {run.data.tokenizer_path or run.data.tokenizer}: {exc}"
    padded = padded_vocab_size(run.model, size, run.parallel.tp)
    return padded, f"padded vocab {padded} ({run.data.tokenizer} tokenizer: {size} ids)"


def recipe_facts(overrides: Sequence[str], vocab: int | None) -> RecipeFacts:
    """Compose the recipe (ConfigError naming the problem, e.g. no recipe=) and read what the
    plan needs."""
    run = load_config(list(overrides))
    chosen = [o.split("=", 1)[1] for o in overrides if o.lstrip("+").startswith("recipe=")]
    padded, vocab_detail = padded_vocab(run, vocab)
    return RecipeFacts(
        name=chosen[-1] if chosen else run.model.name,
        params=None if padded is None else model_parameters(run.model, padded),
        padded_vocab=padded,
        vocab_detail=vocab_detail,
        keep_last=run.checkpoint.keep_last,
        save_interval=run.checkpoint.save_interval,
        dtype="fp32" if run.train.precision == "fp32" else "bf16",
        run=run,
    )


def estimate_step_time(
    facts: RecipeFacts, gpu: str | None, peak: float | None, mfu: float
) -> StepTime:
    """FLOPs per step / (world size x peak x MFU); says what is missing when it cannot."""
    run = facts.run
    precision = "fp8" if run.perf.fp8 else "bf16"
    peak = peak or run.train.peak_tflops
    if peak is None and gpu:
        peak = peak_tflops(gpu, precision)
        if peak is None:
            return StepTime(None, f"no {precision} peak known for {gpu}; give --peak-tflops")
    if peak is None:
        known = ", ".join(sorted(PEAK_TFLOPS))
        return StepTime(None, f"give --step-time, or --gpu ({known}) or --peak-tflops")
    if facts.padded_vocab is None:
        return StepTime(
            None, f"vocabulary size unknown ({facts.vocab_detail}); give --vocab N or --step-time"
        )
    gbs = run.train.global_batch_size
    flops = flops_per_step(run.model, gbs, facts.padded_vocab)
    world = run.launch.world_size
    seconds = flops / (world * peak * 1e12 * mfu)
    return StepTime(
        seconds,
        f"estimated: {flops:.3g} FLOPs/step (global batch {gbs}) / ({world} GPUs x "
        f"{peak:g} TFLOP/s {precision} x {mfu:.0%} MFU, assumed)",
    )
