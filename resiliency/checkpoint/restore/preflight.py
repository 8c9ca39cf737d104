"""What a launcher can judge of a resume before any rank starts: the rules the ranks' restore
applies (tokenizer, topology, the resume policy), on the newest published step's manifest.

A refusal here costs a launcher a second instead of a rank's start-up (imports, a process
group, the lease, a restore plan): tens of seconds and an attempt record. The ranks still
judge the step they actually restore, which may be an older one when the newest does not
verify; this reads no shard, only the manifest and the tokenizer's files. No torch import.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from recipes import ConfigError, RunConfig
from resiliency.checkpoint.restore.resume_policy import reconcile
from resiliency.checkpoint.restore.topology import (
    Target,
    TopologyRefusedError,
    validate,
)
from resiliency.storage.corpus import INDEX_SUFFIX, corpus_changes, describe_change
from resiliency.storage.layout import RunLayout
from resiliency.storage.manifest import Manifest, read_manifest
from resiliency.storage.tokenizer_copy import TOKENIZER_DIR, tokenizer_difference


def target_for(
    run: RunConfig, world_size: int, dp: int, vocab_size: int, tier: str = "persistent"
) -> Target:
    """The restoring job as the topology validator sees it."""
    return Target(
        parallelism=run.parallel.layout(dp),
        world_size=world_size,
        model=dataclasses.asdict(run.model),
        vocab_size=vocab_size,
        padded_vocab_size=run.model.padded_vocab_size,
        global_batch_size=run.train.global_batch_size,
        load_optimizer=run.checkpoint.load_optimizer,
        batch_change_lr_scaling=run.checkpoint.batch_change_lr_scaling,
        tier=tier,
    )


def check_tokenizer(
    manifest: Manifest, path: str | None, step_dir: Path, init_from: str | None = None
) -> None:
    """The running tokenizer's files are the checkpoint's, or ConfigError with the difference
    (a step saved before tokenizers travelled with checkpoints records none: not checked).
    ``init_from``: the step is a warm start's source, named so in the refusal."""
    saved = manifest.tokenizer.get("files")
    if saved is None:
        return
    difference = tokenizer_difference(saved, path)
    if difference is None:
        return
    copy = step_dir / TOKENIZER_DIR
    if len(saved) == 1 and path and Path(path).is_file():
        copy = copy / next(iter(saved))
    if init_from is not None:
        raise ConfigError(
            f"checkpoint.init_from={init_from} refused: {step_dir.name} of run "
            f"{manifest.run_id!r} was trained with another tokenizer than "
            f"data.tokenizer_path={path}: {difference}. Train from it with its own copy "
            f"(data.tokenizer_path={copy}); data tokenized by another tokenizer needs "
            "preparing again with that one"
        )
    raise ConfigError(
        f"restore refused: {step_dir.name} was trained with another tokenizer than "
        f"data.tokenizer_path={path}: {difference}. Continue it with its own copy "
        f"(data.tokenizer_path={copy}), or start a new run (another run_id)"
    )


def newest_manifest(layout: RunLayout) -> tuple[Path, Manifest] | None:
    """The newest published step whose manifest reads (its shards are not looked at)."""
    for step in reversed(layout.published_steps()):
        step_dir = layout.step_dir(step)
        try:
            return step_dir, read_manifest(step_dir)
        except (OSError, ValueError):
            continue  # the ranks' restore skips a step that does not read, and so does this
    return None


def judge_resume(run: RunConfig, run_dir: Path, world_size: int, dp: int) -> int | None:
    """Raise what the ranks' restore would raise for the newest published step: ConfigError
    (another tokenizer, a must-match key changed: exit 2) or TopologyRefusedError (exit 3).
    The step judged, or None when there is nothing to resume."""
    if not run.checkpoint.resume:
        return None
    found = newest_manifest(RunLayout.from_run_dir(run_dir))
    if found is None:
        return None
    step_dir, manifest = found
    check_tokenizer(manifest, run.data.tokenizer_path, step_dir)
    check_must_match(run, manifest)
    # The same tokenizer files (or none recorded): the vocab is the step's; the ranks compare
    # the loaded tokenizer's size as well.
    vocab = int(manifest.tokenizer.get("vocab_size") or 0)
    target = target_for(run, world_size, dp, vocab)
    if manifest.weights_only:  # nothing of the optimizer to reshard: any layout loads it
        target = dataclasses.replace(target, load_optimizer=False)
    report = validate(manifest, target)
    if report.refused:
        raise TopologyRefusedError(
            f"checkpoint step {manifest.step} cannot be restored into this layout:\n"
            f"{report.table()}"
        )
    check_policy(run, manifest)  # the schedule too
    check_corpus_unchanged(run, manifest, step_dir)
    return manifest.step


def corpus_to_check(run: RunConfig, manifest: Manifest) -> dict[str, str] | None:
    """The index checksums the step recorded, where a resume compares them with data.paths'
    (indexed data on both sides; a step saved before they were recorded has none)."""
    saved = manifest.dataset.get("index_files")
    saved_kind = manifest.config.get("data", {}).get("kind", "indexed")
    if saved is None or run.data.kind != "indexed" or saved_kind != "indexed":
        return None
    return dict(saved)


def corpus_refusal(step_dir: Path, changes: list[dict[str, Any]]) -> ConfigError:
    what = "; ".join(describe_change(c) for c in changes)
    return ConfigError(
        f"restore refused: {step_dir.name} was trained on another corpus than data.paths "
        f"holds now: {what}. Its data cursor counts samples of the {INDEX_SUFFIX} files it "
        "recorded, so it would now select other samples. Continue anyway with "
        "data.allow_changed_corpus=true, or start a new run (another run_id)"
    )


def check_corpus_unchanged(run: RunConfig, manifest: Manifest, step_dir: Path) -> None:
    """The corpus refusal the ranks' restore makes (data.paths' index files are not the ones
    the step recorded, and data.allow_changed_corpus is off): one read of each .idx."""
    saved = corpus_to_check(run, manifest)
    if saved is None or run.data.allow_changed_corpus:
        return
    changes = corpus_changes(saved, list(run.data.paths))
    if changes:
        raise corpus_refusal(step_dir, changes)


def check_policy(run: RunConfig, manifest: Manifest) -> None:
    """The resume policy (resume_policy.py) on the step's recorded config: ConfigError (exit 2)
    for a must-match key (model shape, data, seeds, precision...) or an unasked schedule
    change."""
    carried = manifest.tokenizer.get("files") is not None
    checked = frozenset({"data.tokenizer_path"} if carried else ())
    reconcile(run, manifest.config, manifest.step, checked, manifest.weights_only)


def check_must_match(run: RunConfig, manifest: Manifest) -> None:
    """The policy's must-match keys alone (schedule changes are judged after the topology, as
    they always were): before the topology, whose own model check would call a changed model
    shape a layout refusal (exit 3) where the docs promise a config error (exit 2)."""
    lenient = dataclasses.replace(run.checkpoint, schedule_on_resume="config")
    check_policy(dataclasses.replace(run, checkpoint=lenient), manifest)
