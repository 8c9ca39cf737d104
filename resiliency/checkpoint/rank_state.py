"""Per-rank and loop state that is not in the model/optimizer shards.

Rank state (RNG streams) is stored as plain tensors and lists so it loads with
``torch.load(weights_only=True)``: nothing in a checkpoint is unpickled as arbitrary objects.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from resiliency.storage.layout import TRAIN_STATE_NAME

RANK_STATE_DIR = "rank-state"


def rank_state_path(step_dir: Path, rank: int) -> Path:
    return step_dir / RANK_STATE_DIR / f"rank-{rank:05d}.pt"


def capture_rng(device: str) -> dict[str, Any]:
    # megatron-core: imported after the CPU shim is applied (pretrain/distributed.py)
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "numpy": [
            name,
            torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            int(pos),
            int(has_gauss),
            float(cached),
        ],
        "torch": torch.get_rng_state(),
        "tracker": {k: v.clone() for k, v in get_cuda_rng_tracker().get_states().items()},
    }
    if device == "cuda":
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng(state: dict[str, Any], device: str) -> None:
    # megatron-core: imported after the CPU shim is applied (pretrain/distributed.py)
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if device == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


def reseed_rng(seed: int, step: int, rank: int) -> int:
    """Deterministic fresh streams after a topology change (old per-rank states don't map)."""
    # megatron-core: imported after the CPU shim is applied (pretrain/distributed.py)
    from megatron.core import tensor_parallel

    derived = (seed * 1_000_003 + step * 1_009 + rank) % (2**31 - 1)
    random.seed(derived)
    np.random.seed(derived)
    torch.manual_seed(derived)
    tensor_parallel.model_parallel_cuda_manual_seed(derived)
    return derived


def save_rank_state(step_dir: Path, rank: int, state: dict[str, Any]) -> Path:
    path = rank_state_path(step_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, path)
    return path


def load_rank_state(step_dir: Path, rank: int) -> dict[str, Any]:
    return torch.load(rank_state_path(step_dir, rank), map_location="cpu", weights_only=True)


def write_train_state(step_dir: Path, state: dict[str, Any]) -> None:
    (step_dir / TRAIN_STATE_NAME).write_text(json.dumps(state, indent=1, sort_keys=True))


def read_train_state(step_dir: Path) -> dict[str, Any]:
    return json.loads((step_dir / TRAIN_STATE_NAME).read_text())
