"""Work a run starts before torch is imported: providers registered under the
``mcore_recipes.early_start`` entry point (pyproject.toml) get the run's config and this
process's rank and start background work of their own (the resiliency package prefetches the
checkpoint it will restore). Torch-free, so the imports that follow overlap with that work."""

from __future__ import annotations

import logging
import os
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from recipes.config.run import RunConfig

log = logging.getLogger(__name__)
EARLY_PROVIDERS = "mcore_recipes.early_start"


def start_early(run: RunConfig) -> None:
    """Every provider's early work for this process (rank and world size from torchrun's
    environment). An optimisation only: a provider that fails is logged and skipped."""
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    run_dir = Path(run.output_dir) / run.run_id
    try:
        providers = sorted(entry_points(group=EARLY_PROVIDERS), key=lambda e: e.name)
    except Exception as exc:  # noqa: BLE001 - broken package metadata: no head start
        log.warning("early start skipped: %s", exc)
        return
    for entry in providers:
        try:
            entry.load()(run, run_dir, rank, world_size)
        except Exception as exc:  # noqa: BLE001 - never fail a run for a head start
            log.warning("early start %s skipped: %s", entry.name, exc)
