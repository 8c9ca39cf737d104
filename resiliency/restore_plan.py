"""Choose the step to restore and validate its topology, before any model is built."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from recipes.schema import RunConfig
from resiliency.checkpointer import broadcast_object
from resiliency.failures import TopologyRefusedError
from resiliency.layout import RunLayout
from resiliency.manifest import Manifest, read_manifest
from resiliency.select import select_restore_step
from resiliency.topology import Target, TopologyReport, validate
from resiliency.verify import balanced_share, checksum_problem

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RestorePlan:
    step_dir: Path
    manifest: Manifest
    report: TopologyReport


def select_checkpoint(layout: RunLayout, run_id: str, full_verify: bool) -> Path | None:
    """The newest verified step, the same on every rank (collective).

    Rank 0 picks the newest step whose marker, manifest and file sizes check out; with
    ``full_verify`` every rank then re-hashes its share of that step's files (one read of the
    checkpoint spread over all ranks, which also warms the page cache for the load). A bad
    file rejects the step for every rank and the pick moves on to the next one.
    """
    rejected: dict[int, str] = {}
    logged: set[tuple[str, str]] = set()
    while True:
        choice = None
        if dist.get_rank() == 0:
            selection = select_restore_step(layout, run_id, full_verify=False, rejected=rejected)
            for skipped in selection.skipped:
                if skipped not in logged:  # a re-pick lists earlier skips again
                    logged.add(skipped)
                    log.warning("restore: skipped %s: %s", *skipped)
            choice = (str(selection.step_dir), selection.step) if selection.step_dir else None
        choice = broadcast_object(choice)
        if choice is None:
            log.info("restore: no verified checkpoint in %s; starting fresh", layout.run_dir)
            return None
        step_dir, step = Path(choice[0]), choice[1]
        problem = _rehash_together(step_dir) if full_verify else None
        if problem is None:
            return step_dir
        rejected[step] = problem


def _rehash_together(step_dir: Path) -> str | None:
    """First checksum problem any rank found in its share of ``step_dir``'s files, or None."""
    files = read_manifest(step_dir).files
    mine = balanced_share(files, dist.get_rank(), dist.get_world_size())
    problem = next((p for e in mine if (p := checksum_problem(step_dir / e.path, e))), None)
    problems: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    return next((p for p in problems if p is not None), None)


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
