"""Per-rank and loop state that is not in the model/optimizer shards.

Rank state (RNG streams) is stored as plain tensors and lists, so it loads with torch's weights-only
unpickler admitting the checkpoint allow-list only (pretrain/platform/checkpoint_globals.py:
tensors, dtypes, storage types): a file naming any other global is refused unrun.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

# The RNG streams are captured in pretrain/platform/rng.py (evaluation holds them still too).
from pretrain.platform.compat import safe_torch_load
from pretrain.platform.rng import capture_rng as capture_rng
from pretrain.platform.rng import reseed_rng as reseed_rng
from pretrain.platform.rng import restore_rng as restore_rng
from resiliency.storage.layout import TRAIN_STATE_NAME

RANK_STATE_DIR = "rank-state"


def rank_state_path(step_dir: Path, rank: int) -> Path:
    return step_dir / RANK_STATE_DIR / f"rank-{rank:05d}.pt"


def save_rank_state(step_dir: Path, rank: int, state: dict[str, Any]) -> Path:
    path = rank_state_path(step_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, path)
    return path


def load_rank_state(step_dir: Path, rank: int) -> dict[str, Any]:
    path = rank_state_path(step_dir, rank)
    return safe_torch_load(path, f"{RANK_STATE_DIR}/{path.name}", map_location="cpu")


def write_train_state(step_dir: Path, state: dict[str, Any]) -> None:
    (step_dir / TRAIN_STATE_NAME).write_text(json.dumps(state, indent=1, sort_keys=True))


def read_train_state(step_dir: Path) -> dict[str, Any]:
    return json.loads((step_dir / TRAIN_STATE_NAME).read_text())
