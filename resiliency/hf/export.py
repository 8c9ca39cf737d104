"""A published step as a transformers model directory: config.json, model.safetensors and the
run's tokenizer, read from the step's global tensors (any layout, either optimizer format)."""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from pretrain.data.tokenizer import Tokenizer, build_tokenizer
from recipes import ConfigError
from recipes.config.run import RunConfig
from recipes.load import load_config_dict
from resiliency.hf.convert import hf_config, to_hf
from resiliency.hf.tokenizer_files import write_tokenizer_dir
from resiliency.storage.layout import MODEL_DIR
from resiliency.storage.manifest import Manifest
from resiliency.storage.tokenizer_copy import TOKENIZER_DIR
from resiliency.storage.verify import expected_run_id, verify_step_dir

log = logging.getLogger(__name__)
WEIGHTS_FILE = "model.safetensors"


class ExportError(Exception):
    """The step cannot be exported (it does not verify, or its model has no HF family)."""


@dataclass(frozen=True)
class VerifiedStep:
    step_dir: Path
    manifest: Manifest
    run: RunConfig


def open_step(step_dir: Path, run_id: str | None = None) -> VerifiedStep:
    """The step, fully re-hashed against its manifest first: an export of a torn or bit-rotted
    checkpoint would be a model nobody trained. ``run_id``: the run it must belong to (default:
    the one its manifest records, so a copied run exports too)."""
    step_dir = step_dir.resolve()
    run_id, note = expected_run_id(step_dir, run_id)
    if note:
        log.info("%s", note)
    verdict = verify_step_dir(step_dir, run_id, full=True)
    if not verdict.ok or verdict.manifest is None:
        raise ExportError(f"{step_dir} does not verify: {verdict.reason}")
    return VerifiedStep(step_dir, verdict.manifest, load_config_dict(verdict.manifest.config))


def read_model_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every model tensor of a torch_dist checkpoint at its global shape, in one process: the
    checkpoint's metadata holds the global shapes, so the saving layout does not matter."""
    # torch.distributed.checkpoint: only for exports and imports, not the training path
    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = FileSystemReader(str(model_dir))
    metadata = reader.read_metadata().state_dict_metadata
    tensors = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.items()
        if isinstance(meta, TensorStorageMetadata) and not key.startswith("optimizer.")
    }
    load(tensors, storage_reader=reader, no_dist=True)
    return tensors


def export_step(
    step_dir: Path, out: Path, force: bool = False, run_id: str | None = None
) -> VerifiedStep:
    """Write the transformers directory ``out`` for the published step ``step_dir``."""
    started = time.perf_counter()
    step = open_step(step_dir, run_id)
    model, tokenizer = step.run.model, step.manifest.tokenizer
    vocab = int(tokenizer["vocab_size"])
    tensors = read_model_tensors(step.step_dir / MODEL_DIR)
    dtype = tensors["embedding.word_embeddings.weight"].dtype
    try:
        eod = getattr(step_tokenizer(step), "eod", None)
        config = hf_config(model, vocab, dtype, eod)
        weights = to_hf(tensors, model, vocab)
    except ConfigError as exc:
        raise ExportError(str(exc)) from None
    _prepare_out(out, force)
    save_file(weights, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    files = sorted((step.step_dir / TOKENIZER_DIR).glob("*"))
    write_tokenizer_dir(out, tokenizer["kind"], files, eod, model.seq_length)
    (out / "mcore_recipes_export.json").write_text(json.dumps(_provenance(step), indent=2) + "\n")
    log.info(
        "export: step %d of run %s -> %s (%s, %d tensors, %.1f MiB, %.1f s)",
        step.manifest.step,
        step.manifest.run_id,
        out,
        config["architectures"][0],
        len(weights),
        sum(t.numel() * t.element_size() for t in weights.values()) / 2**20,
        time.perf_counter() - started,
    )
    return step


def step_tokenizer(step: VerifiedStep) -> Tokenizer:
    """The run's tokenizer from the step's own copy of its files (the path it was trained
    from may be gone or re-pointed)."""
    kind = step.manifest.tokenizer["kind"]
    path = None if kind == "byte" else str(step.step_dir / TOKENIZER_DIR)
    return build_tokenizer(kind, path)


def _prepare_out(out: Path, force: bool) -> None:
    if out.exists() and any(out.iterdir()):
        if not force:
            raise ExportError(f"{out} exists and is not empty (pass --force to replace it)")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)


def _provenance(step: VerifiedStep) -> dict[str, Any]:
    """Which checkpoint this directory came from: enough to find and re-verify it."""
    m = step.manifest
    return {
        "run_id": m.run_id,
        "step": m.step,
        "step_dir": str(step.step_dir),
        "manifest_created_at": m.created_at,
        "parallelism": m.parallelism,
        "optim_format": m.optim_format,
        "tokenizer": m.tokenizer,
        "versions": m.versions,
    }
