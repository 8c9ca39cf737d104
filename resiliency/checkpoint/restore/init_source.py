"""Warm start: the step of another run that a run with no step of its own starts from
(``checkpoint.init_from``, ``checkpoint.init_load``).

Megatron-LM's ``--pretrained-checkpoint`` with ``--finetune`` semantics, Megatron-Bridge's
``checkpoint.pretrained_checkpoint``: the source gives the weights (with
``init_load=weights+optimizer`` Adam's moments too); the step, the data cursor, the LR
schedule, the global batch and the RNG are this run's own, from step 0. The source may be
at any layout: the weights reshard along every dimension, the optimizer state as the
topology validator allows. The model shape and the tokenizer must be the source's (the
resume policy's rules for an imported step, ``resume_policy.reconcile(weights_only=True)``);
data, schedule and precision are this run's to choose.

Used only while the run has no published step: once it saved one, every relaunch resumes its
own steps and ``init_from`` is not looked at again (a relaunch never goes back to the
source). Every step the run publishes records the source in its manifest (``init_from``: the
spec, run id, step and manifest checksum), carried from step to step.

This module reads manifests and markers only (no torch): the launchers call it before any
rank starts, the ranks' restore plan calls it again for the step they load.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pretrain.context import exit_codes
from pretrain.context.failures import ClassifiedError
from pretrain.context.run_dir import RunDir
from recipes import ConfigError, RunConfig
from recipes.config.checkpoint import CheckpointConfig
from resiliency.checkpoint.restore.preflight import check_tokenizer, newest_manifest, target_for
from resiliency.checkpoint.restore.resume_policy import PolicyRefusal, reconcile
from resiliency.checkpoint.restore.topology import Target, TopologyRefusedError, validate
from resiliency.storage.layout import RunLayout, parse_step, step_name
from resiliency.storage.manifest import (
    Manifest,
    ManifestError,
    manifest_checksum,
    read_manifest,
    read_manifest_bytes,
)
from resiliency.storage.select import select_restore_step
from resiliency.storage.signing import SigningKey
from resiliency.storage.verify import verify_step_dir

WITH_OPTIMIZER = "weights+optimizer"


class InitSourceError(ClassifiedError):
    """checkpoint.init_from names steps of which none verifies (exit 10, as a run's own)."""

    kind, exit_code = "checkpoint", exit_codes.CHECKPOINT_IO


@dataclass(frozen=True)
class InitSource:
    """A verified step of another run (or of ``resiliency.hf import``'s output)."""

    spec: str  # checkpoint.init_from as given
    step_dir: Path
    manifest: Manifest
    manifest_checksum: str

    def record(self, init_load: str) -> dict[str, Any]:
        """What the new run's manifests and attempt records say it started from."""
        return {
            "from": self.spec,
            "run_id": self.manifest.run_id,
            "step": self.manifest.step,
            "manifest": self.manifest_checksum,
            "load": self.loads(init_load),
        }

    def loads(self, init_load: str) -> str:
        """What is loaded: an imported step holds no optimizer state to load."""
        return "weights" if self.manifest.weights_only else init_load


def is_remote(spec: str) -> bool:
    return spec.startswith("s3://")


def split_remote(spec: str) -> tuple[str, str]:
    """``s3://bucket[/prefix]/<run_id>`` -> (the store's URL, the run id under it)."""
    url, _, run_id = spec.rstrip("/").rpartition("/")
    if not run_id or url in ("s3:/", "s3:") or not url.startswith("s3://"):
        raise ConfigError(
            f"checkpoint.init_from={spec}: give s3://bucket[/prefix]/<run_id>, the run's "
            "prefix in the object store (its steps are under <run_id>/steps/)"
        )
    return url, run_id


def resolve_local(
    spec: str,
    run_dir: Path,
    rejected: Mapping[int, str] | None = None,
    key: SigningKey | None = None,
) -> InitSource:
    """A step dir (that step), or a run dir (its newest verified step not in ``rejected``).
    A path that is neither: ConfigError (exit 2); steps that do not verify: InitSourceError
    (exit 10). Markers, manifests and file sizes are checked here; every byte is re-hashed by
    the restore that loads it."""
    path = Path(spec).expanduser()
    if not path.exists():
        raise ConfigError(
            f"checkpoint.init_from={spec}: no such file or directory (give a step dir "
            "steps/step-NNNNNNNNN, a run dir, or s3://bucket/prefix/<run_id>)"
        )
    if path.resolve() == Path(run_dir).resolve():
        raise ConfigError(
            f"checkpoint.init_from={spec} is this run's own dir: a run resumes its own steps "
            "without it; drop checkpoint.init_from"
        )
    if parse_step(path.name) is not None:
        return _step_source(spec, path, rejected or {}, key)
    layout = RunLayout.from_run_dir(path)
    if layout.steps_dir.is_dir():
        return _newest_source(spec, layout, rejected or {}, key)
    raise ConfigError(
        f"checkpoint.init_from={spec} is neither a step dir (steps/step-NNNNNNNNN) nor a run "
        "dir (holding steps/)"
    )


def _step_source(
    spec: str, step_dir: Path, rejected: Mapping[int, str], key: SigningKey | None
) -> InitSource:
    step = parse_step(step_dir.name)
    if step in rejected:
        raise InitSourceError(f"checkpoint.init_from={spec} does not verify: {rejected[step]}")
    try:  # the step names its own run: a step copied out of its run dir is still that run's
        run_id = read_manifest(step_dir).run_id
    except (ManifestError, OSError) as exc:
        raise InitSourceError(f"checkpoint.init_from={spec} does not verify: {exc}") from None
    verdict = verify_step_dir(step_dir, run_id, full=False, key=key)
    if not verdict.ok:
        raise InitSourceError(f"checkpoint.init_from={spec} does not verify: {verdict.reason}")
    return _source(spec, step_dir)


def _newest_source(
    spec: str, layout: RunLayout, rejected: Mapping[int, str], key: SigningKey | None
) -> InitSource:
    selection = select_restore_step(layout, layout.run_id, False, rejected, key)
    if selection.step_dir is None:
        reasons = "; ".join(f"{name}: {reason}" for name, reason in selection.skipped)
        raise InitSourceError(
            f"checkpoint.init_from={spec} holds no step that verifies"
            + (f" ({reasons})" if reasons else " (no published step)")
            + "; python -m resiliency verify <step dir> says why"
        )
    return _source(spec, selection.step_dir)


def _source(spec: str, step_dir: Path) -> InitSource:
    raw = read_manifest_bytes(step_dir)
    return InitSource(spec, step_dir, Manifest.from_json(raw), manifest_checksum(raw))


def from_step_dir(spec: str, step_dir: Path) -> InitSource:
    """A source already chosen (and verified) by rank 0, as the other ranks read it."""
    return _source(spec, step_dir)


def fetched_dir(run_dir: Path, run_id: str) -> RunLayout:
    """Where a remote source's step is downloaded: inside this run's dir, so that an attempt
    that fails before its first save does not download it again."""
    return RunLayout(RunDir(run_dir).init_source_dir, run_id)


def judge(run: RunConfig, source: InitSource) -> RunConfig:
    """The run as it trains from ``source``: ConfigError (exit 2) when the model shape, the
    tokenizer or (loading the optimizer) the optimizer's kind differ from the source's; the
    source's padded vocab pinned (it is the embedding's shape)."""
    manifest, cfg = source.manifest, run.checkpoint
    check_tokenizer(manifest, run.data.tokenizer_path, source.step_dir, source.spec)
    carried = manifest.tokenizer.get("files") is not None
    checked = frozenset({"data.tokenizer_path"} if carried else ())
    # Step 0: this run trains from the start, whatever step the source had reached.
    try:
        reconcile(run, manifest.config, 0, checked, weights_only=True)
    except PolicyRefusal as exc:
        lines = "; ".join(c.describe() for c in exc.changes)
        raise ConfigError(
            f"checkpoint.init_from={source.spec}: {step_name(manifest.step)} of run "
            f"{manifest.run_id!r} is another model than this run's ({lines}); warm start "
            "needs the same model shape and tokenizer"
        ) from None
    saved_optimizer = manifest.config.get("optimizer", {}).get("name")
    if source.loads(cfg.init_load) == WITH_OPTIMIZER and saved_optimizer != run.optimizer.name:
        raise ConfigError(
            f"checkpoint.init_from={source.spec}: init_load=weights+optimizer loads "
            f"{saved_optimizer!r} state into optimizer.name={run.optimizer.name!r}; use "
            "checkpoint.init_load=weights or the source's optimizer"
        )
    padded = manifest.tokenizer.get("padded_vocab_size")
    model = dataclasses.replace(run.model, padded_vocab_size=padded)
    return dataclasses.replace(run, model=model)


def loads_optimizer(cfg: CheckpointConfig, source: InitSource) -> bool:
    return source.loads(cfg.init_load) == WITH_OPTIMIZER


def init_target(
    run: RunConfig, world_size: int, dp: int, vocab_size: int, source: InitSource
) -> Target:
    """The warm-started job as the topology validator sees it: the optimizer state resharded
    only when it is loaded; the global batch is this run's own (nothing trained at it yet)."""
    target = target_for(run, world_size, dp, vocab_size)
    saved_batch = source.manifest.config.get("train", {}).get("global_batch_size")
    return dataclasses.replace(
        target,
        load_optimizer=loads_optimizer(run.checkpoint, source),
        global_batch_size=saved_batch,
    )


def judge_warm_start(run: RunConfig, run_dir: Path, world_size: int, dp: int) -> int | None:
    """For a launcher, before any rank starts: raise what the ranks would for
    checkpoint.init_from on this run's first launch (a missing or unverified source, another
    model or tokenizer, a layout its optimizer state cannot reshard to). The source's step,
    or None when there is no warm start to judge (the run has a step of its own, no
    init_from, or an s3:// source, which only the ranks download)."""
    spec = run.checkpoint.init_from
    if not run.checkpoint.enabled or spec is None or is_remote(spec):
        return None
    if run.checkpoint.resume and newest_manifest(RunLayout.from_run_dir(run_dir)) is not None:
        return None  # a relaunch: its own steps win
    source = resolve_local(spec, run_dir)
    judge(run, source)
    vocab = int(source.manifest.tokenizer.get("vocab_size") or 0)
    report = validate(source.manifest, init_target(run, world_size, dp, vocab, source))
    if report.refused:
        raise TopologyRefusedError(
            f"checkpoint.init_from={spec}: step {source.manifest.step} cannot be loaded into "
            f"this layout:\n{report.table()}"
        )
    return source.manifest.step
