"""Megatron-LM argument names and Megatron-Bridge config paths, mapped to this schema's keys.

Users arrive with ``--tensor-model-parallel-size`` or Bridge's
``model.tensor_model_parallel_size`` in their fingers; an unknown key whose last part is one of
these names gets "that is parallel.tp here" instead of a fuzzy match. Each entry is tested
to name a real key (tests/unit/recipes/test_config_hints.py).
"""

from __future__ import annotations

# Megatron-LM's argument name (dashes as underscores), as Bridge spells it too -> our key. Names
# that are also ours (lr, seed, num_layers, ...) are not here: a wrong prefix on one of those
# is a typo, and the fuzzy match names the key.
MEGATRON_NAMES: dict[str, str] = {
    "tensor_model_parallel_size": "parallel.tp",
    "pipeline_model_parallel_size": "parallel.pp",
    "context_parallel_size": "parallel.cp",
    "expert_model_parallel_size": "parallel.ep",
    "virtual_pipeline_model_parallel_size": "parallel.vpp",
    "train_iters": "train.train_steps",
    "lr_warmup_iters": "scheduler.warmup_steps",
    "lr_decay_iters": "scheduler.decay_steps",
    "lr_decay_style": "scheduler.decay_style",
    "save": "output_dir",
    "load": "output_dir",
    "data_path": "data.paths",
    "tokenizer_type": "data.tokenizer",
    "tokenizer_model": "data.tokenizer_path",
    "recompute_granularity": "perf.recompute",
}


def megatron_hint(bad: str) -> str | None:
    """'that is <ours> here' when the unknown key's last part is a Megatron/Bridge name."""
    name = bad.rsplit(".", 1)[-1].replace("-", "_").lstrip("_")
    ours = MEGATRON_NAMES.get(name)
    if ours is None or ours == bad:
        return None
    return f"that is {ours} here (a Megatron-LM / Megatron-Bridge name)"
