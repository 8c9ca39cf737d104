"""A published step as a transformers model directory: config.json, model.safetensors and the
run's tokenizer, read from the step's global tensors (any layout, either optimizer format)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from pretrain.data.tokenizer import Tokenizer, TokenizerError, build_tokenizer
from recipes import ConfigError
from recipes.config.run import RunConfig
from recipes.load import load_config_dict
from resiliency.hf.convert import hf_config, to_hf
from resiliency.hf.tokenizer_files import (
    LIBRARY_KINDS,
    library_tokenizer_json,
    write_tokenizer_dir,
)
from resiliency.hf.tokenizer_json import TokenizerConversionError
from resiliency.storage.layout import MODEL_DIR
from resiliency.storage.manifest import Manifest
from resiliency.storage.tokenizer_copy import TOKENIZER_DIR
from resiliency.storage.verify import expected_run_id, verify_step_dir

log = logging.getLogger(__name__)
WEIGHTS_FILE = "model.safetensors"


class ExportError(Exception):
    """The step cannot be exported: a usage or config problem (its model has no HF family, its
    tokenizer cannot be read or converted, ``--out`` is in the way or cannot be written)."""


class StepNotVerified(ExportError):
    """The step does not verify against its manifest."""


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
        raise StepNotVerified(f"{step_dir} does not verify: {verdict.reason}")
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
    try:
        step = open_step(step_dir, run_id)
        config, weights = _write_export(step, out, force)
    except (ConfigError, TokenizerError, TokenizerConversionError) as exc:
        raise ExportError(str(exc)) from None
    except OSError as exc:  # --out not writable, a full disk
        raise ExportError(f"{exc.filename or out}: {exc.strerror or exc}") from None
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


def _write_export(
    step: VerifiedStep, out: Path, force: bool
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """config.json, model.safetensors, the tokenizer and the provenance into ``out``; the
    config and the weights written."""
    model, record = step.run.model, step.manifest.tokenizer
    vocab = int(record["vocab_size"])
    tensors = read_model_tensors(step.step_dir / MODEL_DIR)
    dtype = tensors["embedding.word_embeddings.weight"].dtype
    tokenizer = step_tokenizer(step)
    config = hf_config(model, vocab, dtype, getattr(tokenizer, "eod", None))
    weights = to_hf(tensors, model, vocab)
    # Converted before out is touched: a tokenizer with no transformers form (exit 2) leaves
    # a previous export whole instead of weights without a tokenizer.
    converted = (
        library_tokenizer_json(record["kind"], tokenizer)
        if record["kind"] in LIBRARY_KINDS
        else None
    )
    _prepare_out(out, force)
    save_file(weights, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    files = sorted((step.step_dir / TOKENIZER_DIR).glob("*"))
    write_tokenizer_dir(out, record["kind"], files, tokenizer, model.seq_length, converted)
    (out / "mcore_recipes_export.json").write_text(json.dumps(_provenance(step), indent=2) + "\n")
    _set_new_file_modes(out)
    return config, weights


def step_tokenizer(step: VerifiedStep) -> Tokenizer:
    """The run's tokenizer from the step's own copy of its files (the path it was trained
    from may be gone or re-pointed)."""
    kind = step.manifest.tokenizer["kind"]
    return build_tokenizer(kind, step_tokenizer_path(step))


def step_tokenizer_path(step: VerifiedStep) -> str | None:
    """What ``data.tokenizer_path`` reads in the step's copy: None for the byte tokenizer; the
    copied file for a tokenizer read from one file (SentencePiece's ``.model``, a tiktoken
    vocabulary, a lone tokenizer.json); else the copy directory. A step saved before
    tokenizers travelled with checkpoints holds no copy: the path the run recorded."""
    record = step.manifest.tokenizer
    if record["kind"] == "byte":
        return None
    copy = step.step_dir / TOKENIZER_DIR
    names = sorted(record.get("files") or ())
    if not names:
        path = record.get("path")
        log.info("export: %s holds no tokenizer copy; reading %s", step.step_dir, path)
        return path
    one_file = len(names) == 1 and (record["kind"] != "huggingface" or names[0].endswith(".json"))
    return str(copy / names[0]) if one_file else str(copy)


def _set_new_file_modes(out: Path) -> None:
    """Every file of ``out`` gets the mode of a new file here (0644 under umask 022):
    safetensors writes 0600 through a temporary file, copies keep their source's mode."""
    umask = os.umask(0)
    os.umask(umask)
    for path in out.iterdir():
        if path.is_file():
            path.chmod(0o666 & ~umask)


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
