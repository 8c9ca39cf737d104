"""Training data: megatron-core GPTDataset (or its mock) plus a global-sample cursor.

The cursor is the number of samples consumed by all data-parallel ranks together. Batch
``k`` of a step for DP rank ``r`` is a fixed slice of the sample order, so restoring the
cursor resumes exactly, and a DP-size change neither skips nor repeats a sample.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from recipes.config.data import DataConfig

from recipes.config.run import RunConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BatchPlan:
    micro_batch_size: int
    num_microbatches: int
    dp_size: int
    dp_rank: int

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.num_microbatches * self.dp_size

    def sample_indices(self, consumed: int, microbatch: int) -> range:
        start = (
            consumed
            + microbatch * self.micro_batch_size * self.dp_size
            + self.dp_rank * self.micro_batch_size
        )
        return range(start, start + self.micro_batch_size)


def build_datasets(
    cfg: DataConfig, tokenizer: Any, seq_length: int, sizes: list[int], cache_dir: Path
) -> tuple[Any, Any, Any]:
    """Train, valid and test splits of ``sizes`` samples (a split of size 0: None), built on
    every rank (rank 0 first, so it writes the index cache)."""
    # megatron-core: imported after the CPU shim is applied (pretrain/platform/distributed.py)
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )

    # megatron-core: imported after the CPU shim is applied (pretrain/platform/distributed.py)
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset

    blend = None
    if cfg.kind == "indexed":
        _check_prefixes(cfg.paths)
        blend = (list(cfg.paths), list(cfg.weights) if cfg.weights else None)
    dataset_config = GPTDatasetConfig(
        random_seed=cfg.seed,
        sequence_length=seq_length,
        blend=blend,
        split=cfg.split,
        path_to_cache=str(cache_dir),
        tokenizer=tokenizer,
        reset_position_ids=cfg.reset_position_ids,
        reset_attention_mask=cfg.reset_attention_mask,
        eod_mask_loss=cfg.eod_mask_loss,
        create_attention_mask=True,
        mmap_bin_files=True,
    )
    dataset_cls = MockGPTDataset if cfg.kind == "mock" else GPTDataset
    built = BlendedMegatronDatasetBuilder(dataset_cls, sizes, lambda: True, dataset_config).build()
    for name, want, split in zip(("train", "valid", "test"), sizes, built):
        if want and (split is None or len(split) < want):
            raise ValueError(
                f"the {name} split has {0 if split is None else len(split)} samples but "
                f"{want} are needed; add data, change data.split, or lower "
                + ("train.train_steps" if name == "train" else "train.eval_iters")
            )
    train, valid, test = built
    return train, valid if sizes[1] else None, test if sizes[2] else None


def _check_prefixes(prefixes: list[str]) -> None:
    for prefix in prefixes:
        for suffix in (".bin", ".idx"):
            if not Path(prefix + suffix).is_file():
                raise FileNotFoundError(
                    f"data prefix {prefix!r}: {prefix + suffix} not found; build it with "
                    f"`python -m pretrain.data.prepare` (see README)"
                )


def dataset_fingerprint(cfg: DataConfig) -> dict[str, Any]:
    """What identifies the data snapshot: prefixes, weights, split and seed."""
    return {
        "kind": cfg.kind,
        "paths": list(cfg.paths),
        "weights": list(cfg.weights) if cfg.weights else None,
        "split": cfg.split,
        "seed": cfg.seed,
        "tokenizer": cfg.tokenizer,
        "tokenizer_path": cfg.tokenizer_path,
    }


def microbatches(
    dataset: Any, plan: BatchPlan, consumed: int, digests: list[int] | None = None
) -> list[dict[str, torch.Tensor]]:
    """This DP rank's microbatches for the global batch starting at ``consumed``; with
    ``digests``, each sample's :func:`sample_digest` appended to it."""
    batches = []
    for k in range(plan.num_microbatches):
        indices = plan.sample_indices(consumed, k)
        samples = [dataset[i] for i in indices]
        if digests is not None:
            digests.extend(sample_digest(i, s) for i, s in zip(indices, samples))
        batches.append({key: torch.stack([s[key] for s in samples]) for key in samples[0]})
    return batches


SAMPLE_DIGEST_BITS = 32


def sample_digest(index: int, sample: dict[str, torch.Tensor]) -> int:
    """A 32-bit digest of one training sample: its index in the training split and its
    tokens. A step's sample hash is the sum of its samples' digests over every DP rank: the
    same whichever rank drew which sample, so runs at different DP sizes compare."""
    hasher = hashlib.blake2b(index.to_bytes(8, "little"), digest_size=SAMPLE_DIGEST_BITS // 8)
    hasher.update(sample["tokens"].numpy().tobytes())
    return int.from_bytes(hasher.digest(), "little")


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {key: value.to(device, non_blocking=True) for key, value in batch.items()}


def split_sizes(run: RunConfig, plan: BatchPlan) -> list[int]:
    """Samples per split: the whole training run; eval_iters global batches to validate on
    (and to test on at the end, when data.split gives the test split any weight)."""
    per_eval = run.train.eval_iters * plan.global_batch_size if run.train.eval_interval else 0
    test = per_eval if run.data.split_weights[2] > 0 else 0
    return [run.train.train_steps * plan.global_batch_size, per_eval, test]
