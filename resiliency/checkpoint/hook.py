"""The checkpoint hook: the run's lease and attempt, restore at start, saves on schedule and at
planned exits. Other features read what it restored and saved; none of them patches it."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pretrain.context import exit_codes
from pretrain.context.failures import classify
from pretrain.context.run_dir import append_jsonl
from pretrain.data.tokenizer import build_tokenizer
from pretrain.platform.compat import vpp_tied_embedding_save_problem
from pretrain.platform.distributed import broadcast_object, probe_ranks
from pretrain.train.hooks import StepResult, TrainHook
from recipes import ConfigError
from resiliency.checkpoint.checkpointer import Checkpointer
from resiliency.checkpoint.local.tier import LocalTier
from resiliency.checkpoint.restore.plan import plan_restore
from resiliency.checkpoint.restore.resume_policy import ResumeDecision, reconcile
from resiliency.checkpoint.write.async_writer import SpawnedWriterQueue
from resiliency.checkpoint.write.shard_writer import writer_checksums
from resiliency.health import HEALTH_DIR_ENV, read_reports
from resiliency.storage.attempts import (
    TERMINAL_STATUSES,
    claim_attempt,
    ensure_run_record,
    write_attempt_record,
)
from resiliency.storage.layout import RunLayout
from resiliency.storage.lease import LeaseHeldError, LeaseLostError, RunLease, process_identity
from resiliency.storage.object_retry import ObjectStoreUnavailable
from resiliency.storage.remote_preflight import RemotePreflightError, check_remote

if TYPE_CHECKING:
    from pretrain.platform.distributed import DistEnv
    from pretrain.train.view import TrainerView
    from recipes.schema import RunConfig
    from resiliency.checkpoint.local.tier import LocalTier
    from resiliency.checkpoint.restore.resume_policy import ResumeDecision, reconcile
from resiliency.checkpoint.restore.plan import RestorePlan

log = logging.getLogger(__name__)


class RunOwnership:
    """Rank 0 holds the run's single-writer lease and claims an attempt id for all ranks.

    The lease's generation fences every write a restore would see (``fence``); when the
    heartbeat finds the lease taken over, ``lost`` says by whom and the hook stops the run at
    the next step boundary with exit 6."""

    def __init__(self, layout: RunLayout, lease_timeout_s: float) -> None:
        self.layout, self.timeout_s = layout, lease_timeout_s
        self.lease: RunLease | None = None
        self.attempt = -1
        self.info: dict[str, Any] = {}

    @property
    def fence(self) -> RunLease | None:
        """Rank 0's lease, which every publish, latest.json move and delete holds."""
        return self.lease

    @property
    def lost(self) -> LeaseLostError | None:
        return self.lease.lost if self.lease is not None else None

    def acquire(self, rank: int, world_size: int) -> int:
        error, attempt = None, -1
        if rank == 0:
            try:
                self.info = {
                    "status": "starting",
                    "world_size": world_size,
                    "start_time": time.time(),
                    **process_identity(),
                }
                attempt = self.attempt = claim_attempt(self.layout, self.info)
                self.lease = RunLease(self.layout, attempt, self.timeout_s)
                self.lease.acquire()
                self.lease.start_heartbeat()
                self.record("starting", lease_generation=self.lease.generation)
                ensure_run_record(self.layout, attempt)
            except LeaseHeldError as exc:
                error = str(exc)
        error, self.attempt = broadcast_object((error, attempt))
        if error:
            raise LeaseHeldError(error)
        return self.attempt

    def lost_everywhere(self) -> str | None:
        """Collective: rank 0's word on whether the lease was taken over (why, or None)."""
        lost = self.lost
        return broadcast_object(str(lost) if lost is not None else None)

    def record(self, status: str, **extra: Any) -> None:
        """Update this attempt's record (rank 0); earlier fields are kept."""
        if self.lease is None:
            return
        self.info.update(status=status, **extra)
        if status in TERMINAL_STATUSES:
            self.info["end_time"] = time.time()
        write_attempt_record(self.layout, self.attempt, self.info)

    def release(self) -> None:
        if self.lease is not None:
            self.lease.release()
            self.lease = None


class CheckpointHook(TrainHook):
    """Restore at start, save every ``save_interval`` steps and at the end, publish async saves."""

    def __init__(self, run: "RunConfig", env: "DistEnv", run_dir: Path) -> None:
        self.cfg = run.checkpoint
        self.env = env
        self.layout = RunLayout(run_dir.parent, run.run_id)
        self.ownership = RunOwnership(self.layout, self.cfg.lease_timeout_s)
        self.checkpointer: Checkpointer | None = None
        self.plan: "RestorePlan | None" = None
        self.initialise = True  # the run's own model.perform_initialization
        self.local: "LocalTier | None" = None
        self.decision: ResumeDecision | None = None  # config differences from the checkpoint
        self.health: dict[str, Any] | None = None  # the startup probe and node reports
        self.writer_queue: SpawnedWriterQueue | None = None  # async saves' writer, started early
        self.fenced: str | None = None  # the lease was taken over: why (every rank)
        self.rejected: dict[int, str] = {}  # steps this attempt's restore refused, and why

    def configure(self, run: "RunConfig", dp: int) -> "RunConfig":
        """Take the run's lease, then pick and validate the step to restore (nothing loaded)."""
        problem = vpp_tied_embedding_save_problem(
            run.parallel.vpp,
            run.model.share_embeddings_and_output_weights,
            run.optimizer.use_distributed_optimizer,
            self.cfg.optim_format,
        )
        if problem:
            raise ConfigError(problem)
        self.health = self._probe(run)
        self._check_remote(run.run_id)
        self.ownership.acquire(self.env.rank, self.env.world_size)
        if self.cfg.async_save and self.cfg.staging_buffers:
            # Spawned now, its start-up (an interpreter importing torch and megatron-core,
            # seconds) overlaps the model build and the restore, not the first steps' saves.
            self.writer_queue = SpawnedWriterQueue(writer_checksums().reports)
            self.writer_queue.writer.start()
        self.initialise = run.model.perform_initialization
        if self.cfg.resume:
            vocab = build_tokenizer(run.data.tokenizer, run.data.tokenizer_path).vocab_size
            run, self.plan = plan_restore(
                run, self.layout, self.env.world_size, dp, vocab, None, self.ownership.attempt
            )
        return self._model_init_for_plan(self._reconcile(run))

    def _check_remote(self, run_id: str) -> None:
        """checkpoint.remote: rank 0 probes the object store (credentials, bucket, conditional
        writes; remote_preflight.py) before the lease and the restore; every rank raises what
        it found, before any model is built: exit 2, or 1 when the store is out (retried)."""
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

    @staticmethod
    def _probe(run: "RunConfig") -> dict[str, Any] | None:
        """Every rank answers one timed collective before the lease and the restore; the
        launcher's node reports (if it ran the check) go into the attempt record with it."""
        if not run.resiliency.health.enabled:
            return None
        probe = probe_ranks(run.resiliency.health.allreduce_timeout_s)
        reports = os.environ.get(HEALTH_DIR_ENV)
        return {**probe, "nodes": read_reports(Path(reports)) if reports else None}

    def _reconcile(self, run: "RunConfig") -> "RunConfig":
        """Judge this launch's config against the one the chosen step was saved with: refuse,
        or say in the log (and later the attempt record) what changes and what is kept."""
        if self.plan is None:
            return run
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
            vocab = trainer.parts.tokenizer.vocab_size
            run, self.plan = plan_restore(
                trainer.run,
                self.layout,
                self.env.world_size,
                trainer.dp,
                vocab,
                rejected,
                self.ownership.attempt,
            )
            trainer.rebuild(self._model_init_for_plan(self._reconcile(run)))

    def on_start(self, trainer: "TrainerView") -> None:
        self._confirm_plan(trainer)
        checkpointer = Checkpointer(
            trainer,
            self.layout,
            self.ownership.attempt,
            trainer.faults,
            self.writer_queue,
            fence=self.ownership.fence,
            rejected_at_restore=frozenset(self.rejected),
        )
        self.writer_queue = None  # the checkpointer's now
        self.checkpointer = checkpointer
        if self.cfg.local.enabled:
            self.local = LocalTier(self.cfg.local, trainer, checkpointer)
        restored, tier = self._restore(checkpointer)
        if self.local is not None:
            self.local.discard_after(restored or 0)
        self.ownership.record(
            "running",
            restored_step=restored,
            restored_tier=tier,
            topology_changed=bool(self.plan and not self.plan.report.same_layout),
            lr_scaling=checkpointer.lr_scaling,
            local_dir=self.cfg.local.dir if self.local else None,
            config_changes=self.decision.record() if self.decision else None,
            health=self.health,
            corpus_changes=self.plan.corpus_changes if self.plan else None,
        )

    def _restore(self, checkpointer: Checkpointer) -> tuple[int | None, str | None]:
        """The local tier when it holds a newer verified step, else the persistent tier."""
        persistent = self.plan.manifest.step if self.plan is not None else None
        if self.local is not None and self.cfg.resume:
            step = self.local.choose(persistent)
            if step is not None:
                self.local.restore(step)
                return step, "local"
        if self.plan is None:
            return None, None
        return checkpointer.restore(
            self.plan.step_dir, self.plan.manifest, self.plan.report.same_layout
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

    def wants_stop(self, trainer: "TrainerView") -> bool:
        return self.ownership.lost is not None  # rank 0's heartbeat saw a takeover

    def after_step(self, trainer: "TrainerView", result: StepResult) -> None:
        assert self.checkpointer is not None
        if result.stop_asked and self._fenced(trainer):
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

    def _fenced(self, trainer: "TrainerView") -> bool:
        """A stop was voted: if it is because the lease was taken over, this attempt writes
        nothing more and leaves with exit 6, the new owner named."""
        lost = self.ownership.lost_everywhere()
        if lost is None:
            return False
        self.fenced = lost
        trainer.request_stop(exit_codes.LEASE_HELD, lost)
        return True

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
        vocab = trainer.parts.tokenizer.vocab_size
        while True:
            _, plan = plan_restore(
                trainer.run, self.layout, self.env.world_size, trainer.dp, vocab, rejected
            )
            if plan is None:
                return None
            step = plan.manifest.step
            problem = f"not older than step {bad_step}" if step >= bad_step else plan.confirm()
            if problem is None:
                return plan
            rejected[step] = problem
            log.warning("rollback: step %d rejected: %s", step, problem)

    def on_anomaly(self, trainer: "TrainerView", result: StepResult, action: str) -> None:
        """The guard's run totals and this attempt's events go into the attempt record."""
        status = self.ownership.info.get("status", "running")
        self.ownership.record(status, guard=trainer.guard.record())

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
        if self.fenced is not None:  # another owner holds the run: no final save
            log.error("run stopped, nothing saved: %s", self.fenced)
            self.ownership.record("fenced", step=trainer.state.step, exit_code=trainer.exit_code)
            return
        # A planned exit always leaves a persistent checkpoint of the final state.
        self.save_now(trainer)
        status = "preempted" if trainer.exit_code == exit_codes.REQUEUE else "finished"
        self.ownership.record(status, step=trainer.state.step, exit_code=trainer.exit_code)

    def on_exception(self, trainer: "TrainerView | None", exc: BaseException) -> None:
        failure = classify(exc)
        step = trainer.state.step if trainer is not None else None
        self.ownership.record(
            "fenced" if failure.kind == "lease" else "failed",
            step=step,
            exit_code=failure.exit_code,
            failure_class=failure.kind,
            error=failure.message[:2000],
        )

    def close(self) -> None:
        if self.checkpointer is not None:
            self.checkpointer.close()
        self.ownership.release()


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
