"""Choose the step to restore and validate its topology, before any model is built."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from recipes.schema import RunConfig
from resiliency.checkpointer import select_checkpoint
from resiliency.failures import TopologyRefusedError
from resiliency.layout import RunLayout
from resiliency.manifest import Manifest, read_manifest
from resiliency.topology import Target, TopologyReport, validate

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RestorePlan:
    step_dir: Path
    manifest: Manifest
    report: TopologyReport


def target_for(run: RunConfig, world_size: int, dp: int, vocab_size: int,
               tier: str = "persistent") -> Target:
    return Target(
        parallelism=run.parallel.layout(dp),
        world_size=world_size, model=dataclasses.asdict(run.model), vocab_size=vocab_size,
        padded_vocab_size=run.model.padded_vocab_size,
        global_batch_size=run.train.global_batch_size,
        load_optimizer=run.checkpoint.load_optimizer,
        batch_change_lr_scaling=run.checkpoint.batch_change_lr_scaling, tier=tier)


def check_topology(manifest: Manifest, target: Target) -> TopologyReport:
    """Validate; a refusal raises with the diff table and the user's options."""
    report = validate(manifest, target)
    if report.refused:
        raise TopologyRefusedError(
            f"checkpoint step {manifest.step} cannot be restored into this layout:\n"
            f"{report.table()}")
    if not report.same_layout and dist.get_rank() == 0:
        log.warning("restore: topology changes from the checkpoint's:\n%s", report.table())
    return report


def plan_restore(run: RunConfig, layout: RunLayout, world_size: int, dp: int,
                 vocab_size: int) -> tuple[RunConfig, RestorePlan | None]:
    """Returns the run config to build (checkpoint's padded vocab pinned) and what to load."""
    step_dir = select_checkpoint(layout, run.run_id, run.checkpoint.full_verify)
    if step_dir is None:
        return run, None
    manifest = read_manifest(step_dir)
    report = check_topology(manifest, target_for(run, world_size, dp, vocab_size))
    padded = manifest.tokenizer.get("padded_vocab_size")
    model = dataclasses.replace(run.model, padded_vocab_size=padded)
    return dataclasses.replace(run, model=model), RestorePlan(step_dir, manifest, report)
