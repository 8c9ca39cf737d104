"""The checkpoint hook: restore at start, saves on schedule and at planned exits, all under the
run's lease (the run context, which the ownership hooks take and release). Other features read
what it restored (``RunContext.restored_step``) and saved; none of them patches it."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch.distributed.checkpoint.api import CheckpointException

from pretrain.context.run_dir import append_jsonl
from pretrain.data.tokenizer import run_tokenizer
from pretrain.platform.compat import vpp_tied_embedding_save_problem
from pretrain.platform.distributed import broadcast_object
from pretrain.train.hooks import StepResult, TrainHook
from recipes import ConfigError
from resiliency.checkpoint.checkpointer import Checkpointer
from resiliency.checkpoint.local.tier import LocalTier
from resiliency.checkpoint.restore.init_source import loads_optimizer
from resiliency.checkpoint.restore.load import EarlyLoad, read_shards
from resiliency.checkpoint.restore.plan import (
    RestorePlan,
    plan_init,
    plan_restore,
    reads_shards_early,
)
from resiliency.checkpoint.restore.resume_policy import ResumeDecision, reconcile
from resiliency.checkpoint.restore.topology import resize_of
from resiliency.checkpoint.write.async_writer import SpawnedWriterQueue
from resiliency.checkpoint.write.shard_writer import writer_checksums
from resiliency.storage.object_retry import ObjectStoreUnavailable
from resiliency.storage.remote_preflight import RemotePreflightError, check_remote

if TYPE_CHECKING:
    from pretrain.platform.distributed import DistEnv
    from pretrain.train.view import TrainerView
    from recipes.config.checkpoint import CheckpointConfig
    from recipes.config.run import RunConfig
    from resiliency.run_context import RunContext

log = logging.getLogger(__name__)


class CheckpointPreflight(TrainHook):
    """Checks of the checkpoint settings that need no model, before the run's lease is taken
    (so a refused launch leaves no attempt): a layout whose saves megatron-core cannot write,
    and checkpoint.remote's object store (credentials, bucket, conditional writes)."""

    def __init__(self, cfg: "CheckpointConfig", env: "DistEnv") -> None:
        self.cfg, self.env = cfg, env

    def configure(self, run: "RunConfig", dp: int) -> "RunConfig":
        problem = vpp_tied_embedding_save_problem(
            run.parallel.vpp,
            run.model.share_embeddings_and_output_weights,
            run.optimizer.use_distributed_optimizer,
            self.cfg.optim_format,
        )
        if problem:
            raise ConfigError(problem)
        self._check_remote(run.run_id)
        return run

    def _check_remote(self, run_id: str) -> None:
        """checkpoint.remote: rank 0 probes the object store (credentials, bucket, conditional
        writes; remote_preflight.py); every rank raises what it found, before any model is
        built: exit 2, or 1 when the store is out (retried)."""
        if not self.cfg.remote.enabled:
            return
        error: Exception | None = None
        if self.env.rank == 0:
            try:
                check_remote(self.cfg.remote, run_id, at_launch=False)
            except (RemotePreflightError, ObjectStoreUnavailable) as exc:
                error = exc
        error = broadcast_object(error)
        if error is not None:
            raise error


class CheckpointHook(TrainHook):
    """Restore at start, save every ``save_interval`` steps and at the end, publish async saves."""

    def __init__(self, run: "RunConfig", env: "DistEnv", ctx: "RunContext") -> None:
        self.cfg = run.checkpoint
        self.env = env
        self.ctx = ctx
        self.layout = ctx.layout
        self.checkpointer: Checkpointer | None = None
        self.plan: "RestorePlan | None" = None
        self.initialise = True  # the run's own model.perform_initialization
        self.local: "LocalTier | None" = None
        self.decision: ResumeDecision | None = None  # config differences from the checkpoint
        self.writer_queue: SpawnedWriterQueue | None = None  # async saves' writer, started early
        self.rejected: dict[int, str] = {}  # steps this attempt's restore refused, and why
        self._early: EarlyLoad | None = None  # the planned step, read before its confirm
        self.dp = 1  # data-parallel size, known at configure

    def configure(self, run: "RunConfig", dp: int) -> "RunConfig":
        """Under the run's lease (taken by the ownership hook just before), pick and validate
        the step to restore (nothing loaded)."""
        if self.cfg.async_save and self.cfg.staging_buffers:
            # Spawned now, its start-up (an interpreter importing torch and megatron-core,
            # seconds) overlaps the model build and the restore, not the first steps' saves.
            self.writer_queue = SpawnedWriterQueue(writer_checksums().reports)
            self.writer_queue.writer.start()
        self.initialise = run.model.perform_initialization
        self.dp = dp
        if self.cfg.resume or self.cfg.init_from:
            run, self.plan = self._plan_restore(run, self.rejected)
        run = self._model_init_for_plan(self._reconcile(run))
        self.cfg = run.checkpoint  # one generation: the section the run trains with
        return run

    def _plan_restore(
        self, run: "RunConfig", rejected: dict[int, str], for_attempt: bool = True
    ) -> "tuple[RunConfig, RestorePlan | None]":
        """The newest step to restore that is none of ``rejected`` (the only call of
        plan_restore): at start and after a failed re-hash for this attempt (which may
        download a remote step for it), or for a rollback. For an attempt of a run with no
        step of its own, checkpoint.init_from's step (a warm start; never for a rollback)."""
        vocab = run_tokenizer(run.data.tokenizer, run.data.tokenizer_path).vocab_size
        attempt = self.ctx.attempt if for_attempt else 0
        world, plan = self.env.world_size, None
        if self.cfg.resume:
            run, plan = plan_restore(run, self.layout, world, self.dp, vocab, rejected, attempt)
        if plan is None and for_attempt and self.cfg.init_from is not None:
            run, plan = plan_init(
                run, self.layout.run_dir, world, self.dp, vocab, rejected, attempt
            )
        return run, plan

    def _reconcile(self, run: "RunConfig") -> "RunConfig":
        """Judge this launch's config against the one the chosen step was saved with: refuse,
        or say in the log (and later the attempt record) what changes and what is kept."""
        if self.plan is None or self.plan.init is not None:
            return run  # a warm start's source was judged by its own rules (init_source.py)
        manifest = self.plan.manifest
        # A checkpoint that carries its tokenizer had its files compared by content already.
        carried = manifest.tokenizer.get("files") is not None
        checked = frozenset({"data.tokenizer_path"} if carried else ())
        self.decision = reconcile(
            run, manifest.config, manifest.step, checked, manifest.weights_only
        )
        if self.env.rank == 0:
            for change in self.decision.applied:
                log.info("resume: %s (%s, applied)", change.describe(), change.kind)
            for change in self.decision.kept:
                log.warning("resume: %s: the checkpoint's value is kept", change.describe())
        return self.decision.run

    def _model_init_for_plan(self, run: "RunConfig") -> "RunConfig":
        if self.plan is None:
            if not self.initialise:
                raise ConfigError(
                    "model.perform_initialization=false leaves the weights "
                    "uninitialised, and there is no checkpoint to restore them "
                    f"from in {self.layout.steps_dir}; drop the override"
                )
            # Back on for a rebuild whose first plan had turned it off.
            return dataclasses.replace(
                run, model=dataclasses.replace(run.model, perform_initialization=True)
            )
        # Every parameter is about to be overwritten by the checkpoint: skip drawing them.
        return dataclasses.replace(
            run, model=dataclasses.replace(run.model, perform_initialization=False)
        )

    def _confirm_plan(self, trainer: "TrainerView") -> None:
        """The chosen step was re-hashed while the model was built; when a file is bad, plan
        the next step and rebuild the model for it (uninitialised only if it has a step)."""
        rejected = self.rejected
        while self.plan is not None and (problem := self.plan.confirm()) is not None:
            rejected[self.plan.manifest.step] = problem
            log.warning(
                "restore: step %d failed its re-hash (%s); planning the next step and "
                "rebuilding the model",
                self.plan.manifest.step,
                problem,
            )
            run, self.plan = self._plan_restore(trainer.run, rejected)
            self._early = None  # it holds the old model's tensors: let the rebuild free them
            trainer.rebuild(self._model_init_for_plan(self._reconcile(run)))

    def on_start(self, trainer: "TrainerView") -> None:
        planned = self.plan
        # With the node-local tier on, a newer local step may win: nothing read in vain.
        if planned is not None and reads_shards_early(self.cfg):
            self._early = self._read_early(trainer)
        self._confirm_plan(trainer)
        early, self._early = self._early, None
        if self.plan is not planned:  # another step, and a rebuilt model: read again
            early = None
        checkpointer = Checkpointer(
            trainer,
            self.ctx,
            trainer.faults,
            self.writer_queue,
            rejected_at_restore=frozenset(self.rejected),
        )
        self.writer_queue = None  # the checkpointer's now
        self.checkpointer = checkpointer
        if self.cfg.local.enabled:
            self.local = LocalTier(self.cfg.local, trainer, checkpointer)
        checkpointer.init_source = self._lineage()
        restored, tier = self._restore(checkpointer, early)
        if self.local is not None:
            self.local.discard_after(restored or 0)
        self.ctx.restored_step = restored
        self.ctx.update(
            restored_step=restored,
            restored_tier=tier,
            topology_changed=bool(self.plan and not self.plan.report.same_layout),
            lr_scaling=checkpointer.lr_scaling,
            local_dir=self.cfg.local.dir if self.local else None,
            config_changes=self.decision.record() if self.decision else None,
            init_from=checkpointer.init_source,
            corpus_changes=self.plan.corpus_changes if self.plan else None,
            resized=(
                resize_of(self.plan.manifest, self.env.world_size, self.dp)
                if self.plan is not None and restored is not None
                else None
            ),
        )

    def _lineage(self) -> dict[str, Any] | None:
        """The warm start this run began with: the plan's source, or what its own step
        recorded (carried into every manifest it writes)."""
        if self.plan is None:
            return None
        if self.plan.init is not None:
            return self.plan.init.record(self.cfg.init_load)
        return self.plan.manifest.init_from

    def _load_section(self) -> "CheckpointConfig":
        """What the planned step's load reads: a warm start loads the optimizer state only
        with checkpoint.init_load=weights+optimizer (and a source that has it)."""
        assert self.plan is not None
        if self.plan.init is None:
            return self.cfg
        return dataclasses.replace(
            self.cfg, load_optimizer=loads_optimizer(self.cfg, self.plan.init)
        )

    def _read_early(self, trainer: "TrainerView") -> EarlyLoad | None:
        """Collective: the planned step's shards read into place while its files are still
        re-hashed (both read the same files: one pass from the disk, not two in a row).
        Nothing is applied until the re-hash confirms the step; if it does not, the model is
        rebuilt (``_confirm_plan``), so what was read here is gone.

        Every rank must enter and leave the load's collectives together. The small files the
        load reads before any shard are checked first, by every rank, and agreed on (None:
        a problem there; the confirm rejects the step). A failed shard read is one torch DCP
        raises on every rank (``CheckpointException``): it is judged after the re-hash, which
        explains it when a file is bad (``restore()`` raises it otherwise). Any other error is
        raised here, as it was after the confirm."""
        assert self.plan is not None
        # train.fault's restore point: where the restore's reading begins (restore() then
        # only applies what was read here, and does not stop again).
        trainer.faults.at_checkpoint("restore", self.plan.manifest.step)
        check = self.plan.share_check
        try:
            if self.plan.check_metadata_files(self.cfg.full_verify) is not None:
                return None
            started = time.perf_counter()
            try:
                return read_shards(
                    trainer.parts,
                    self.plan.step_dir,
                    self.plan.manifest,
                    self._load_section(),
                    check,
                )
            except CheckpointException as exc:  # a BaseException, raised on every rank alike
                return EarlyLoad(error=exc, seconds=time.perf_counter() - started)
        finally:
            if check is not None:  # the read is over: the re-hash takes the share's rest
                check.release()

    def _restore(
        self, checkpointer: Checkpointer, early: EarlyLoad | None = None
    ) -> tuple[int | None, str | None]:
        """The local tier when it holds a newer verified step, else the persistent tier (or,
        with neither, a warm start's source)."""
        plan = self.plan
        persistent = plan.manifest.step if plan is not None and plan.init is None else None
        if self.local is not None and self.cfg.resume:
            step = self.local.choose(persistent)
            if step is not None:
                self.local.restore(step)
                return step, "local"
        if self.plan is None:
            return None, None
        if self.plan.init is not None:  # this run's step 0 is the source's state
            with_optimizer = self._load_section().load_optimizer
            checkpointer.warm_start(self.plan.step_dir, self.plan.manifest, with_optimizer, early)
            return None, None
        return checkpointer.restore(
            self.plan.step_dir, self.plan.manifest, self.plan.report.same_layout, early
        ), self.plan.tier

    def before_step(self, trainer: "TrainerView") -> None:
        assert self.checkpointer is not None
        if self.checkpointer.pending is None:
            return
        with trainer.checkpointing("commit"):  # may publish an async save: collective I/O
            self.checkpointer.finalize(blocking=False)

    def tier_due(self, step: int) -> str | None:
        """Which tier saves after ``step``: persistent wins when both are due."""
        if _due(self.cfg.save_interval, step):
            return "persistent"
        if self.cfg.local.enabled and _due(self.cfg.local.interval, step):
            return "local"
        return None

    def after_step(self, trainer: "TrainerView", result: StepResult) -> None:
        assert self.checkpointer is not None
        if self.ctx.fenced is not None:  # the lease was taken over: write nothing more
            return
        tier = self.tier_due(result.step)
        if tier is None:
            self._reserve_staging(trainer, result.step)
            return
        record_to = self._blocked_record(trainer)
        with trainer.checkpointing(f"{tier} save"), _blocked_time(record_to, tier, result.step):
            if tier == "persistent":
                self.checkpointer.save()
            else:
                assert self.local is not None
                self.local.save()

    def _blocked_record(self, trainer: "TrainerView") -> Path | None:
        return self.layout.dir.checkpoint_metrics if trainer.env.rank == 0 else None

    def _reserve_staging(self, trainer: "TrainerView", step: int) -> None:
        """Once per attempt, at the first step no save follows: the dry run that sizes the
        staging buffers is checkpoint work on the training thread, recorded as such."""
        assert self.checkpointer is not None
        if not self.checkpointer.staging_to_reserve:
            return
        record_to = self._blocked_record(trainer)
        with trainer.checkpointing("staging"), _blocked_time(record_to, "staging", step):
            self.checkpointer.reserve_staging()

    def roll_back(self, trainer: "TrainerView", bad_step: int) -> int | None:
        """train.guard.policy=rollback|replay: restore, in place, the newest persistent step
        older than ``bad_step`` that verifies (re-hashed unless checkpoint.full_verify is off);
        local-tier steps after it belong to the abandoned trajectory and are dropped."""
        assert self.checkpointer is not None
        with trainer.checkpointing("rollback"):
            self.checkpointer.finalize(blocking=True)  # a save in flight predates the bad step
            plan = self._rollback_plan(trainer, bad_step)
            if plan is None:
                return None
            step = self.checkpointer.restore(plan.step_dir, plan.manifest, plan.report.same_layout)
            if self.local is not None:
                self.local.discard_after(step)
        return step

    def _rollback_plan(self, trainer: "TrainerView", bad_step: int) -> "RestorePlan | None":
        rejected: dict[int, str] = {}
        while True:
            _, plan = self._plan_restore(trainer.run, rejected, for_attempt=False)
            if plan is None:
                return None
            step = plan.manifest.step
            problem = f"not older than step {bad_step}" if step >= bad_step else plan.confirm()
            if problem is None:
                return plan
            rejected[step] = problem
            log.warning("rollback: step %d rejected: %s", step, problem)

    def save_now(self, trainer: "TrainerView") -> None:
        """Persist the current step unless it is already published (planned exits)."""
        assert self.checkpointer is not None
        with trainer.checkpointing("final save"):
            self._save_unless_persisted(self.checkpointer, trainer.state.step)

    @staticmethod
    def _save_unless_persisted(checkpointer: Checkpointer, step: int) -> None:
        checkpointer.finalize(blocking=True)
        persisted = {checkpointer.stats.last_step}
        if checkpointer.restored_tier == "persistent":
            persisted.add(checkpointer.restored_step)
        # A local copy of this step does not count (Megatron-Bridge #5922).
        if step not in persisted:
            checkpointer.save()
            checkpointer.finalize(blocking=True)

    def on_end(self, trainer: "TrainerView") -> None:
        if self.ctx.fenced is not None:  # another owner holds the run: no final save
            log.error("run stopped, nothing saved: %s", self.ctx.fenced)
            return
        # A planned exit always leaves a persistent checkpoint of the final state (the
        # ownership end hook, after this one, records the attempt as finished or preempted).
        self.save_now(trainer)

    def close(self) -> None:
        if self.checkpointer is not None:
            self.checkpointer.close()


def _due(interval: int | None, step: int) -> bool:
    return bool(interval) and step % interval == 0


@contextlib.contextmanager
def _blocked_time(record_to: Path | None, tier: str, step: int) -> Iterator[None]:
    """Record how long a save kept the training loop waiting (metrics/checkpoints.jsonl, on
    the rank given a path)."""
    started = time.perf_counter()
    yield
    if record_to is not None:
        blocked = time.perf_counter() - started
        append_jsonl(
            record_to, {"tier": tier, "step": step, "blocked_s": blocked, "time": time.time()}
        )
