"""A step's shards read into place: megatron's torch_dist load through the single-pass reader
(streaming.py), into the targets the checkpoint's state dict names (state_dict.py)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pretrain.platform.compat import checkpoint_reader
from resiliency.checkpoint.restore.share_check import ShareCheck
from resiliency.checkpoint.restore.streaming import StreamingReader
from resiliency.checkpoint.state_dict import load_targets
from resiliency.storage.layout import MODEL_DIR
from resiliency.storage.manifest import Manifest

if TYPE_CHECKING:
    from recipes.config.checkpoint import CheckpointConfig

log = logging.getLogger(__name__)


@dataclass
class EarlyLoad:
    """A step's shards read into the model and optimizer-state buffers (or why not)."""

    loaded: dict[str, Any] = field(default_factory=dict)
    error: BaseException | None = None
    seconds: float = 0.0


def read_shards(
    parts: Any,
    step_dir: Path,
    manifest: Manifest,
    cfg: CheckpointConfig,
    share_check: ShareCheck | None = None,
) -> EarlyLoad:
    """Collective: the step's sharded state read into place (megatron's torch_dist load,
    through the single-pass reader, which checks the files of ``share_check`` it reads);
    nothing applied yet (optimizer state, loop state, RNG)."""
    # megatron-core: imported after the CPU shim is applied (pretrain/platform/distributed.py)
    from megatron.core import dist_checkpointing

    started = time.perf_counter()
    with_optimizer = cfg.load_optimizer and not manifest.weights_only
    targets = load_targets(parts, manifest.optim_format, with_optimizer)
    built = time.perf_counter()
    model_dir = step_dir / MODEL_DIR
    reader = StreamingReader(model_dir, share_check)  # each byte read once, into place
    with checkpoint_reader(lambda _: reader):
        loaded = dist_checkpointing.load(targets, str(model_dir))
    done = time.perf_counter()
    checked = len(share_check.checked_paths) if share_check is not None else 0
    log.info(
        "restore: %s in %.2f s (load targets %.2f s); %d of this rank's shard files checked "
        "as they were read",
        reader.stats.describe(),
        done - built,
        built - started,
        checked,
    )
    return EarlyLoad(loaded, seconds=done - started)
