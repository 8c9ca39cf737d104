"""A transformers model directory as the published step 0 of a new run: weights only, so the
run that resumes from it (at any layout) starts with a fresh optimizer and the recipe's
schedule: continued pretraining.

The step is written by the same Checkpointer as every other save (manifest, checksums,
COMMITTED, the run's tokenizer copied in), from the recipe's model built in this process at
world size 1; the checkpoint's global tensors are what makes it loadable at any layout.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from pretrain.data.tokenizer import build_tokenizer
from pretrain.platform.distributed import init_distributed
from pretrain.platform.host import free_port
from pretrain.train.session import build_trainer
from recipes import ConfigError, RunConfig, load_config
from resiliency.checkpoint.checkpointer import Checkpointer
from resiliency.checkpoint.state_dict import model_state_dict
from resiliency.hf.convert import from_hf, model_fields_from_hf, normalised_keys
from resiliency.run_context import RunContext
from resiliency.storage.layout import RunLayout
from resiliency.storage.lease import RunLease

log = logging.getLogger(__name__)
# The process that writes step 0 is one rank: the layout a run resumes at is its own.
IMPORT_LAYOUT = [
    "parallel.tp=1", "parallel.pp=1", "parallel.vpp=null", "parallel.cp=1", "parallel.ep=1",
    "parallel.dp=null", "parallel.sequence_parallel=false", "train.device=cpu",
    "checkpoint.enabled=true", "checkpoint.async_save=false", "model.perform_initialization=false",
]  # fmt: skip
IMPORT_ATTEMPT = 0  # attempts of the training run count from 1


def read_hf_dir(hf_dir: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """config.json and every tensor of the directory's safetensors files."""
    config_path = hf_dir / "config.json"
    if not config_path.is_file():
        raise ConfigError(f"{hf_dir} holds no config.json: not a transformers model directory")
    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{hf_dir} holds no *.safetensors weights (convert .bin files first)")
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        tensors.update(load_file(str(path)))
    return json.loads(config_path.read_text()), tensors


def check_recipe_matches(run: RunConfig, config: dict[str, Any], hf_dir: Path) -> None:
    """The recipe's model is the transformers model, or ConfigError naming each difference."""
    fields = model_fields_from_hf(config)
    differences = [
        f"model.{key}={getattr(run.model, key)} (transformers: {value})"
        for key, value in fields.items()
        if getattr(run.model, key) != value
    ]
    head_dim = config.get("head_dim")
    if head_dim and head_dim != run.model.hidden_size // run.model.num_attention_heads:
        differences.append(f"head_dim {head_dim} != hidden_size / num_attention_heads")
    eps = config.get("rms_norm_eps", config.get("layer_norm_eps", 1e-5))
    if abs(eps - 1e-5) > 1e-12:
        differences.append(f"norm epsilon {eps} (megatron-core here uses 1e-05)")
    if differences:
        fix = " ".join(f"model.{k}={v}" for k, v in fields.items())
        raise ConfigError(
            f"import refused: recipe {run.model.name} is not the model in {hf_dir}: "
            f"{'; '.join(differences)}. Pick the matching recipe or override: {fix}"
        )
    vocab = build_tokenizer(run.data.tokenizer, run.data.tokenizer_path).vocab_size
    if vocab != config["vocab_size"]:
        raise ConfigError(
            f"import refused: the run's tokenizer has {vocab} ids, the model {config['vocab_size']}"
            f"; train with the model's own tokenizer (data.tokenizer=huggingface "
            f"data.tokenizer_path={hf_dir})"
        )


def load_global_tensors(chunks: list[Any], tensors: dict[str, torch.Tensor]) -> int:
    """Copy megatron's global tensors into this rank's model through its sharded state dict
    (each shard's offsets say which part it holds); returns the number of shards filled."""
    # megatron-core: imported after the CPU shim is applied (pretrain/platform/distributed.py)
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    shards = []
    for item in nested_values(model_state_dict(chunks)):
        # SwiGLU's fc1 is a factory: the gate and up halves it builds are views of the weight
        built = nested_values(item.build()) if isinstance(item, ShardedTensorFactory) else [item]
        shards += [shard for shard in built if isinstance(shard, ShardedTensor)]
    with torch.no_grad():  # the shards' data are the parameters themselves
        for shard in shards:
            key = next(iter(normalised_keys({shard.key: None})))
            if key not in tensors:
                raise ConfigError(f"import: the model needs {key}, which the conversion lacks")
            shard.data.copy_(_shard_of(tensors[key], shard))
    return len(shards)


def _shard_of(tensor: torch.Tensor, shard: Any) -> torch.Tensor:
    prepended = len(shard.global_offset) - shard.data.dim()
    index = tuple(shard.global_offset[:prepended]) + tuple(
        slice(offset, offset + size)
        for offset, size in zip(shard.global_offset[prepended:], shard.local_shape)
    )
    return tensor[index]


def import_hf(hf_dir: Path, overrides: list[str]) -> Path:
    """Publish ``hf_dir``'s weights as step 0 of the run the overrides name; its step dir."""
    if not any(o.startswith("run_id=") for o in overrides):
        raise ConfigError("import needs run_id=<name>: the run to create and continue later")
    run = load_config([*overrides, *IMPORT_LAYOUT])
    config, hf_tensors = read_hf_dir(hf_dir)
    check_recipe_matches(run, config, hf_dir)
    layout = RunLayout(Path(run.output_dir), run.run_id)
    if layout.steps_dir.exists() and any(layout.steps_dir.iterdir()):
        raise ConfigError(
            f"import refused: {layout.run_dir} already has checkpoints; import into a new run_id"
        )
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    trainer = build_trainer(run, init_distributed("cpu"), 1, layout.run_dir)
    tensors = from_hf(hf_tensors, run.model, trainer.parts.padded_vocab)
    filled = load_global_tensors(trainer.parts.chunks, tensors)
    log.info("import: %d tensors of %s into %d shards of %s", len(tensors), hf_dir, filled,
             run.model.name)  # fmt: skip
    layout.run_dir.mkdir(parents=True, exist_ok=True)
    with RunLease(layout, IMPORT_ATTEMPT, timeout_s=60.0):
        ctx = RunContext.unowned(layout, IMPORT_ATTEMPT)
        checkpointer = Checkpointer(trainer, ctx, trainer.faults, weights_only=True)
        checkpointer.save()
        checkpointer.close()
    return layout.step_dir(0)
