"""What ``capacity`` takes from a recipe: parameter count, step time, retention and save
interval, by the planner's own formulas (pretrain/fit/timing.py: the parameter count from the
model config alone, the step time from FLOPs over the GPU's peak at an assumed MFU; measure
it, then pass ``--step-time`` or set ``train.step_time_s``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pretrain.fit.timing import StepTime, model_parameters, step_time
from recipes import RunConfig, load_config


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


def padded_vocab(run: RunConfig, vocab: int | None) -> tuple[int | None, str]:
    """Padded vocabulary: the model's pinned size, ``--vocab`` padded as Megatron pads, or the
    recipe's tokenizer (local files only); None with the reason when none of them is there."""
    from pretrain.data.tokenizer import build_tokenizer
    from pretrain.data.vocab import padded_vocab_size

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
    """The planner's step time (pretrain/fit/timing.py) for ``gpu`` (default launch.gpu)."""
    return step_time(facts.run, facts.padded_vocab, gpu, peak, mfu)
