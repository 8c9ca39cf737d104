"""Megatron-LM argument names and Megatron-Bridge config paths, mapped to this schema's keys.

Users arrive with ``--tensor-model-parallel-size`` or Bridge's
``model.tensor_model_parallel_size`` in their fingers; an unknown key whose last part is one of
these names gets "that is parallel.tp here" instead of a fuzzy match. Each entry is tested
to name a real key (tests/test_config_hints.py).
"""

from __future__ import annotations

# Megatron-LM's argument name (dashes as underscores), as Bridge spells it too -> our key.
MEGATRON_NAMES: dict[str, str] = {
    "tensor_model_parallel_size": "parallel.tp",
    "pipeline_model_parallel_size": "parallel.pp",
    "context_parallel_size": "parallel.cp",
    "expert_model_parallel_size": "parallel.ep",
    "virtual_pipeline_model_parallel_size": "parallel.vpp",
    "num_layers_per_virtual_pipeline_stage": "parallel.vpp",
    "sequence_parallel": "parallel.sequence_parallel",
    "micro_batch_size": "train.micro_batch_size",
    "global_batch_size": "train.global_batch_size",
    "train_iters": "train.train_steps",
    "eval_interval": "train.eval_interval",
    "seed": "train.seed",
    "lr": "optimizer.lr",
    "min_lr": "optimizer.min_lr",
    "weight_decay": "optimizer.weight_decay",
    "clip_grad": "optimizer.clip_grad",
    "adam_beta1": "optimizer.adam_beta1",
    "adam_beta2": "optimizer.adam_beta2",
    "use_distributed_optimizer": "optimizer.use_distributed_optimizer",
    "lr_warmup_iters": "scheduler.warmup_steps",
    "lr_decay_iters": "scheduler.decay_steps",
    "lr_decay_style": "scheduler.decay_style",
    "num_layers": "model.num_layers",
    "hidden_size": "model.hidden_size",
    "ffn_hidden_size": "model.ffn_hidden_size",
    "num_attention_heads": "model.num_attention_heads",
    "num_query_groups": "model.num_query_groups",
    "seq_length": "model.seq_length",
    "max_position_embeddings": "model.max_position_embeddings",
    "num_experts": "model.num_experts",
    "save_interval": "checkpoint.save_interval",
    "save": "output_dir",
    "load": "output_dir",
    "data_path": "data.paths",
    "split": "data.split",
    "tokenizer_type": "data.tokenizer",
    "tokenizer_model": "data.tokenizer_path",
    "log_interval": "logging.log_interval",
    "recompute_granularity": "perf.recompute",
    "recompute_method": "perf.recompute_method",
    "recompute_num_layers": "perf.recompute_num_layers",
}


def megatron_hint(bad: str) -> str | None:
    """'that is <ours> here' when the unknown key's last part is a Megatron/Bridge name."""
    name = bad.rsplit(".", 1)[-1].replace("-", "_").lstrip("_")
    ours = MEGATRON_NAMES.get(name)
    if ours is None or ours == bad:
        return None
    return f"that is {ours} here (a Megatron-LM / Megatron-Bridge name)"
