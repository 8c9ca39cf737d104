"""The padded vocabulary: Megatron's rule, without torch (the planners use it too)."""

from __future__ import annotations

import math

from recipes import ConfigError
from recipes.config.model import ModelConfig


def padded_vocab_size(model: ModelConfig, vocab_size: int, tp: int) -> int:
    """Megatron's padding rule unless the model pins the padded size (kept across TP changes)."""
    if model.padded_vocab_size is not None:
        if model.padded_vocab_size < vocab_size:
            raise ConfigError(
                f"model.padded_vocab_size={model.padded_vocab_size} is smaller than "
                f"the tokenizer's vocab size {vocab_size}: set model.padded_vocab_size to at "
                f"least {vocab_size} (a multiple of 128 x TP), or null to pad as Megatron does"
            )
        return model.padded_vocab_size
    multiple = model.make_vocab_size_divisible_by * tp
    return int(math.ceil(vocab_size / multiple) * multiple)
