"""Persistent checkpoints of the full training state through megatron-core dist_checkpointing.

Save: every rank writes its shards and RNG state into ``step-N.tmp-attempt-K``; once all
writers have persisted (at once for sync saves, at a later step boundary for async ones),
ranks checksum a share of the files each, rank 0 writes the manifest and COMMITTED and
publishes the dir by atomic rename. Restore: rank 0 picks the newest verified step, every
rank loads it, and the loaded state is checked against the manifest before training resumes.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from pretrain.context import exit_codes, startup_clock
from pretrain.context.failures import ClassifiedError, classify
from pretrain.data.dataset import dataset_fingerprint
from pretrain.platform.compat import fix_orphaned_writer_manager
from pretrain.platform.distributed import broadcast_object
from pretrain.train.fault_injection import FaultInjector
from resiliency.checkpoint import rank_state as state_io
from resiliency.checkpoint.fingerprint import differences, state_fingerprint
from resiliency.checkpoint.restore import broken
from resiliency.checkpoint.restore.load import EarlyLoad, read_shards
from resiliency.checkpoint.restore.resume_lr import (
    load_optimizer_keeping_schedule,
    scale_lr_for_batch_change,
    schedule_from_config,
    set_group_lrs,
)
from resiliency.checkpoint.state_dict import chunks_by_key, sharded_training_state
from resiliency.checkpoint.write.async_writer import SpawnedWriterQueue
from resiliency.checkpoint.write.shard_writer import in_process_writes, writer_checksums
from resiliency.checkpoint.write.staging import (
    StagingBuffers,
    StagingPlan,
    stage_sharded_state,
    staging_for,
)
from resiliency.storage.checksum import describe_files, describe_written, share_of
from resiliency.storage.corpus import index_files
from resiliency.storage.layout import MODEL_DIR, payload_files
from resiliency.storage.lease import LeaseLostError, RunLease
from resiliency.storage.manifest import (
    Manifest,
    code_commit,
    image_digest,
    merge_file_entries,
    runtime_versions,
)
from resiliency.storage.publish import (
    begin_step,
    fenced,
    publish,
    set_aside,
    write_manifest_and_commit,
)
from resiliency.storage.retention import apply_gc, plan_gc
from resiliency.storage.signing import SIGNED_ALGORITHM, key_from_env
from resiliency.storage.tokenizer_copy import copy_tokenizer, tokenizer_record
from resiliency.storage.verify import verify_step_dir

if TYPE_CHECKING:
    from pretrain.train.view import TrainerView
    from recipes.config.checkpoint import CheckpointConfig
    from resiliency.run_context import RunContext

log = logging.getLogger(__name__)
# torch DCP reports failed writes (e.g. ENOSPC on any rank) as a BaseException subclass.
SAVE_ERRORS = (Exception, CheckpointException)


class CheckpointSaveError(ClassifiedError):
    """A save failed on some rank; the tmp dir was discarded and earlier steps are intact."""

    kind, exit_code = "checkpoint", exit_codes.CHECKPOINT_IO


FINGERPRINT_KEY = "fingerprint"  # in a rank's state file (checkpoint.fingerprint)


class RestoreError(ClassifiedError):
    """The selected checkpoint loaded but does not match its manifest."""

    kind, exit_code = "checkpoint", exit_codes.CHECKPOINT_IO


@dataclass
class PendingSave:
    step: int
    tmp_dir: Path
    started: float
    request: Any = None  # megatron AsyncRequest while writers run in the background


@dataclass
class SaveStats:
    durations_s: list[float] = field(default_factory=list)
    last_success_time: float | None = None
    last_step: int | None = None


class Checkpointer:
    def __init__(
        self,
        trainer: "TrainerView",
        ctx: "RunContext",
        faults: FaultInjector,
        writer_queue: SpawnedWriterQueue | None = None,
        weights_only: bool = False,
        rejected_at_restore: frozenset[int] = frozenset(),
        cfg: CheckpointConfig | None = None,
    ) -> None:
        """What it saves and restores: the model chunks, optimizer, scheduler and loop state
        ``trainer`` (the view) holds. ``ctx``: the run's layout, this attempt, and rank 0's run
        lease, which every publish, set-aside and retention delete holds (nothing is written
        once another owner took the run over). ``faults``: train.fault's points inside the save
        protocol. ``cfg``: its own checkpoint section (default: the run's).
        ``writer_queue``: a spawned writer already started (by the checkpoint hook, before
        the model was built); used if async saves stage into shared memory, else closed.
        ``weights_only``: saves hold no optimizer state (python -m resiliency.hf import).
        ``rejected_at_restore``: published steps this attempt's restore refused (a re-hash
        that failed, maybe only on an I/O error): one reached again is set aside, not kept."""
        self.trainer, self.layout, self.attempt = trainer, ctx.layout, ctx.attempt
        self.fence, self.rejected_at_restore = ctx.fence, rejected_at_restore
        self.faults = faults  # train.fault's points inside the save protocol (tests, drill)
        self.cfg = cfg or trainer.run.checkpoint
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.pending: PendingSave | None = None
        self.queue: Any = None
        self.stats = SaveStats()
        self.restored_step: int | None = None
        self.restored_tier: str | None = None  # "persistent" | "local"
        # What the run was warm-started from (checkpoint.init_from), recorded in every
        # manifest this run writes; set by the checkpoint hook from its restore plan.
        self.init_source: dict[str, Any] | None = None
        self.lr_scaling: dict[str, Any] | None = None
        self._dataset_snapshot: dict[str, Any] | None = None
        # Seconds per phase of the last save (logged, and read by bench/).
        self.phase_times: dict[str, float] = {}
        self._gc_thread: threading.Thread | None = None
        self._strategy: Any = None  # megatron save strategy, built by the first save
        self.staging = self._staging() if self.cfg.staging_buffers else None
        self._reserved = False  # reserve_staging ran (once per attempt)
        self.weights_only = weights_only
        fix_orphaned_writer_manager()
        if self.cfg.async_save and self.staging is not None and self.staging.shared:
            self.queue = writer_queue
            self._async_queue().writer.start()  # warm before the first save needs it
        elif writer_queue is not None:  # /dev/shm too small: megatron forks per save instead
            writer_queue.close(abort=True)

    # ---------------------------------------------------------------- save
    def save(self) -> None:
        """Start a save of the current state; sync saves are published before returning."""
        self.finalize(blocking=True)  # one save in flight at a time
        self._reserved = True  # this save sizes the staging buffers, if none did yet
        step = self.trainer.state.step
        started = time.perf_counter()
        self.phase_times = {}
        tmp = self._begin(step)
        writer_checksums().drain()  # reports of an aborted save, if any
        try:
            request = self._write_shards(tmp)
            state_io.save_rank_state(tmp, self.rank, self._rank_state())
            if self.rank == 0:
                state_io.write_train_state(tmp, self.trainer.state_dict())
                copy_tokenizer(tmp, self.trainer.run.data.tokenizer_path)
        except SAVE_ERRORS as exc:
            self._abort(tmp, exc)
        self.phase_times["save_call"] = time.perf_counter() - started
        self.pending = PendingSave(step, tmp, started, request)
        if request is None:
            self._commit()
        else:
            request.add_finalize_fn(self._commit)
            self._async_queue().schedule_async_request(request)
            writer = getattr(self.queue, "writer", None)  # the spawned writer, if any
            if writer is not None and writer.process is not None:
                self.faults.at_checkpoint("writer", step, writer.process.pid)
            if self.rank == 0:
                log.info("checkpoint step %d: writing in the background", step)

    def _rank_state(self) -> dict[str, Any]:
        """RNG streams, and with checkpoint.fingerprint the live state's fingerprint."""
        state = state_io.capture_rng(self.trainer.env.device)
        if self.cfg.fingerprint:
            parts = self.trainer.parts
            state[FINGERPRINT_KEY] = state_fingerprint(parts.chunks, parts.optimizer)
        return state

    def check_fence(self, what: str) -> None:
        """Collective: LeaseLostError on every rank when rank 0's lease was taken over (for
        writes done on every rank, like the node-local tier's, that no one mutex covers)."""
        lost = None
        if self.fence is not None:
            try:
                with self.fence.hold(what):
                    pass
            except LeaseLostError as exc:
                lost = str(exc)
        lost = broadcast_object(lost)
        if lost is not None:
            raise LeaseLostError(lost)

    @property
    def staging_to_reserve(self) -> bool:
        """Async saves into staging buffers this attempt has not reserved yet."""
        return self.cfg.async_save and self.staging is not None and not self._reserved

    def reserve_staging(self) -> None:
        """Ahead of the first async save of an attempt (after a step, so the optimizer state
        exists): a dry run of the save's state dict names every staging buffer, and they are
        allocated and faulted in on a thread while training goes on, so the first save blocks
        no longer than later ones."""
        if not self.staging_to_reserve:
            return
        assert self.staging is not None
        self._reserved = True
        plan = StagingPlan(self.staging.shared)
        parts, fmt = self.trainer.parts, self.cfg.optim_format
        stage_sharded_state(sharded_training_state(parts, fmt, staging=plan), plan)
        self.staging.reserve_in_background(plan.entries)

    def finalize(self, blocking: bool = False) -> None:
        """Publish async saves whose writers are done (collective: call on every rank)."""
        if self.queue is not None and self.queue.get_num_unfinalized_calls():
            try:
                self.queue.maybe_finalize_async_calls(blocking=blocking)
            except SAVE_ERRORS as exc:
                if self.pending is None:  # the commit itself failed and cleaned up already
                    raise
                self._abort(self.pending.tmp_dir, exc)  # e.g. ENOSPC in a background writer

    def _begin(self, step: int) -> Path:
        """Rank 0 creates the tmp dir; a failure there is raised on every rank alike."""
        tmp, error, lost = None, None, None
        if self.rank == 0:
            try:
                # Under the lease: a stale owner woken from a stall must learn it is fenced
                # here, not by tripping over a step the new owner has already published.
                self._set_aside_rejected(step)  # fenced itself (and the mutex is not reentrant)
                with fenced(self.fence, f"starting checkpoint step {step}"):
                    tmp = str(begin_step(self.layout, step, self.attempt))
                (Path(tmp) / MODEL_DIR).mkdir()
            except LeaseLostError as exc:
                lost = str(exc)
            except Exception as exc:  # noqa: BLE001 - shared with every rank below
                error = f"{type(exc).__name__}: {exc}"
        tmp, error, lost = broadcast_object((tmp, error, lost))
        if lost:
            raise LeaseLostError(lost)
        if error:
            raise CheckpointSaveError(f"cannot start checkpoint step {step}: {error}")
        return Path(tmp)

    def _set_aside_rejected(self, step: int) -> None:
        """A published dir at this step that fails verification was rejected at restore."""
        final = self.layout.step_dir(step)
        if final.exists():
            key = key_from_env(self.cfg.signing_key_env)  # an unsigned step is rejected too
            verdict = verify_step_dir(final, self.trainer.run.run_id, self.cfg.full_verify, key)
            if verdict.ok and step in self.rejected_at_restore:
                verdict = replace(verdict, ok=False, reason="refused by this attempt's restore")
            if not verdict.ok:
                moved = set_aside(self.layout, step, verdict.reason, self.fence)
                log.warning(
                    "checkpoint step %d: invalid published dir moved to %s (%s)",
                    step,
                    moved.name,
                    verdict.reason,
                )

    def _write_shards(self, tmp: Path) -> Any:
        # megatron-core: imported after the CPU shim is applied (pretrain/platform/distributed.py)
        from megatron.core import dist_checkpointing

        start = time.perf_counter()
        sharded = sharded_training_state(
            self.trainer.parts,
            self.cfg.optim_format,
            with_optimizer=not self.weights_only,
            staging=self.staging,
            snapshot=self.cfg.async_save,
        )
        self.phase_times["state_dict"] = time.perf_counter() - start
        if self.staging is not None:
            start = time.perf_counter()
            stage_sharded_state(sharded, self.staging, snapshot=self.cfg.async_save)
            self.phase_times["stage"] = time.perf_counter() - start
        first = self._strategy is None
        request = dist_checkpointing.save(
            sharded,
            str(tmp / MODEL_DIR),
            sharded_strategy=self._save_strategy(),
            async_sharded_save=True,
            validate_access_integrity=first,
        )
        if not self.cfg.async_save:
            start = time.perf_counter()
            in_process_writes(request).execute_sync()
            self.phase_times["write"] = time.perf_counter() - start
            return None
        if self.staging is not None and self.staging.shared:  # the spawned writer runs it
            return in_process_writes(request)
        return request  # fork per save: the fork is the snapshot

    def _save_strategy(self) -> Any:
        """One strategy for the whole run: the state dict's structure does not change within
        a run, so megatron caches the save plan in it (and the replica distribution over DP
        ranks) after the first save, which alone validates the sharding (Megatron-LM's
        --ckpt-assume-constant-structure)."""
        # megatron-core: imported after the CPU shim is applied (pretrain/platform/distributed.py)
        from megatron.core import parallel_state as ps
        from megatron.core.dist_checkpointing.strategies.fully_parallel import (
            FullyParallelSaveStrategyWrapper,
        )

        # megatron-core: imported after the CPU shim is applied (pretrain/platform/distributed.py)
        from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

        if self._strategy is None:
            # megatron's default (torch_dist, version 1), with our number of writers per rank.
            strategy = TorchDistSaveShardedStrategy(
                "torch_dist", 1, cached_metadata=True, thread_count=self.cfg.writer_threads
            )
            if ps.get_data_parallel_world_size(with_context_parallel=True) > 1:
                # Replicas are split across DP ranks: each byte is written once, by one rank.
                strategy = FullyParallelSaveStrategyWrapper(
                    strategy,
                    ps.get_data_parallel_group(with_context_parallel=True),
                    do_cache_distribution=True,
                )
            self._strategy = strategy
        return self._strategy

    def _staging(self) -> StagingBuffers:
        params = [p for chunk in self.trainer.parts.chunks for p in chunk.parameters()]
        param_bytes = sum(p.numel() * p.element_size() for p in params)
        ranks_on_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        return staging_for(self.cfg.async_save, param_bytes, ranks_on_node)

    def _async_queue(self) -> Any:
        # megatron-core: imported after the CPU shim is applied (pretrain/platform/distributed.py)
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        if self.queue is None:
            if self.staging is not None and self.staging.shared:
                # The state is a private copy in shared memory: a spawned writer saves it.
                self.queue = SpawnedWriterQueue(writer_checksums().reports)
            else:
                # Fork per save (the fork is the snapshot); megatron's persistent caller leaked
                # later in-place updates of live tensors (see shared cpu-feasibility notes).
                self.queue = AsyncCallsQueue(persistent=False)
        return self.queue

    def _commit(self) -> None:
        """Collective: checksum shares, then rank 0 commits, publishes and collects garbage."""
        pending = self.pending
        assert pending is not None
        failure: str | None = None
        self.trainer.checkpoint_phase("commit")
        self.faults.at_checkpoint("save", pending.step)
        phase = time.perf_counter()
        dist.barrier()  # every rank's shards and rank-state file are on disk
        self.phase_times["writers_wait"] = time.perf_counter() - phase
        phase = time.perf_counter()
        try:
            mine = self._describe_payload(pending.tmp_dir)
        except SAVE_ERRORS as exc:  # noqa: BLE001 - reported collectively below
            failure, mine = f"rank {self.rank}: {exc}", []
        self.phase_times["checksums"] = time.perf_counter() - phase
        phase = time.perf_counter()
        gathered: list[Any] = [None] * self.world
        dist.all_gather_object(gathered, (failure, mine))
        failures = [f for f, _ in gathered if f]
        if failures:
            self._abort(pending.tmp_dir, CheckpointSaveError("; ".join(failures)))
        fenced = None
        if self.rank == 0:
            try:
                self._publish(pending, merge_file_entries(entries for _, entries in gathered))
            except LeaseLostError as exc:
                fenced = str(exc)
            except Exception as exc:  # noqa: BLE001 - shared with every rank below
                failure = f"rank 0: {exc}"
        failure, fenced = broadcast_object((failure, fenced))
        if fenced:  # another owner holds the run: its steps dir is not ours to touch
            self.pending = None
            raise LeaseLostError(fenced)
        if failure:
            self._abort(pending.tmp_dir, CheckpointSaveError(failure))
        self.phase_times["publish"] = time.perf_counter() - phase
        duration = time.perf_counter() - pending.started
        self.stats.durations_s.append(duration)
        self.stats.last_success_time, self.stats.last_step = time.time(), pending.step
        self.pending = None
        self.faults.after_commit(pending.step, self.layout.step_dir(pending.step) / MODEL_DIR)

    def _describe_payload(self, tmp_dir: Path) -> list[Any]:
        """This rank's manifest entries: the files its writers hashed while writing them, plus
        a round-robin share of the rest (metadata, rank state, anything a writer did not
        report), which is read back and hashed. Collective."""
        files = broadcast_object(payload_files(tmp_dir) if self.rank == 0 else None)
        reports = writer_checksums().drain()
        if self.cfg.signing_key_env is not None:  # a signature binds sha256, not crc32c
            return describe_files(tmp_dir, share_of(files, self.rank, self.world), SIGNED_ALGORITHM)
        root = tmp_dir.absolute()
        written = {}
        for path, (size, checksum) in reports.items():
            rel = Path(path).relative_to(root).as_posix() if path.startswith(f"{root}/") else None
            if rel in files:
                written[rel] = (size, checksum)
        claimed: list[Any] = [None] * self.world
        dist.all_gather_object(claimed, sorted(written))
        known = {rel for ranks in claimed for rel in ranks}
        rest = [rel for rel in files if rel not in known]
        entries = [describe_written(tmp_dir, rel, *written[rel]) for rel in sorted(written)]
        return entries + describe_files(tmp_dir, share_of(rest, self.rank, self.world))

    def _publish(self, pending: PendingSave, files: list[Any]) -> None:
        self._check_loadable(pending.tmp_dir / MODEL_DIR)
        manifest, key = self._manifest(pending.step, files), key_from_env(self.cfg.signing_key_env)
        write_manifest_and_commit(pending.tmp_dir, manifest, key)
        self.faults.at_checkpoint("publish", pending.step)
        final = publish(self.layout, pending.tmp_dir, pending.step, fence=self.fence)
        log.info(
            "checkpoint step %d published: %s (%.2f s)",
            pending.step,
            final,
            time.perf_counter() - pending.started,
        )
        self._join_gc()
        plan = plan_gc(
            self.layout,
            self.trainer.run.run_id,
            self.cfg.keep_last,
            self.cfg.milestone_interval,
            protected=set(),
            live_attempt=self.attempt,
        )
        if plan.deletions:
            # Unlinking a GiB-sized old step took 0.25 s of a 0.33 s async commit: do it off
            # the training thread. A dir is renamed to .trash- before it is emptied, so a crash
            # midway leaves trash the next collection removes, never a half-deleted step.
            self._gc_thread = threading.Thread(
                target=self._apply_gc, args=(plan, self.fence), name="checkpoint-gc", daemon=True
            )
            self._gc_thread.start()

    @staticmethod
    def _apply_gc(plan: Any, fence: RunLease | None) -> None:
        try:
            for path in apply_gc(plan, fence):
                log.debug("retention: removed %s", path.name)  # one INFO line per save
        except LeaseLostError as exc:  # the heartbeat stops the run; nothing was deleted
            log.error("retention: %s", exc)
        except Exception:  # noqa: BLE001 - the published step stands; the next save retries
            log.exception("retention: garbage collection failed")

    def _join_gc(self) -> None:
        if self._gc_thread is not None:
            self._gc_thread.join()
            self._gc_thread = None

    @staticmethod
    def _check_loadable(model_dir: Path) -> None:
        # megatron-core: imported after the CPU shim is applied (pretrain/platform/distributed.py)
        from megatron.core.dist_checkpointing.core import check_is_distributed_checkpoint
        from torch.distributed.checkpoint import FileSystemReader

        if not check_is_distributed_checkpoint(str(model_dir)):
            raise CheckpointSaveError(f"{model_dir} has no readable dist-checkpoint metadata")
        FileSystemReader(str(model_dir)).read_metadata()

    def _manifest(self, step: int, files: list[Any]) -> Manifest:
        run, parts = self.trainer.run, self.trainer.parts
        return Manifest(
            run_id=run.run_id,
            attempt=self.attempt,
            step=step,
            world_size=self.world,
            parallelism=run.parallel.layout(parts.plan.dp_size),
            optim_format=self.cfg.optim_format,
            versions=runtime_versions(),
            code_commit=code_commit(),
            image_digest=image_digest(),
            dataset=self._dataset(),
            config=asdict(run),
            files=files,
            weights_only=self.weights_only,
            init_from=self.init_source,
            tokenizer={
                "kind": run.data.tokenizer,
                "path": run.data.tokenizer_path,
                "vocab_size": parts.tokenizer.vocab_size,
                "padded_vocab_size": parts.padded_vocab,
                "files": tokenizer_record(files),  # the copies in tokenizer/
            },
        )

    def _dataset(self) -> dict[str, Any]:
        if self._dataset_snapshot is None:
            snapshot = dataset_fingerprint(self.trainer.run.data)
            snapshot["index_files"] = index_files(list(self.trainer.run.data.paths))
            self._dataset_snapshot = snapshot
        return self._dataset_snapshot

    def _abort(self, tmp: Path, exc: BaseException) -> None:
        self.pending = None
        space = self._space_report()  # before cleanup frees the partial write
        # Any rank that sees the failure removes the dir: an async failure reaches ranks at
        # different points, and the launcher may stop the others before they get here.
        shutil.rmtree(tmp, ignore_errors=True)
        if self.fence is not None and self.fence.lost is not None:
            # The heartbeat saw a takeover: the new owner's work explains the failure (a step
            # it published, its cleanup), and this attempt leaves fenced, not as a disk error.
            raise self.fence.lost from exc
        if classify(exc).kind == "infrastructure":
            # A peer lost in the save's collectives (it was killed, or hung and torn down):
            # not a storage problem, and retried like any other lost peer.
            raise exc
        hidden = ""
        if "iostream error" in str(exc):  # torch's C++ zip writer drops the OS error
            hidden = (
                " (torch's file writer does not say which OS error: a full file system or "
                "quota, or an I/O error of the storage)"
            )
        raise CheckpointSaveError(
            f"checkpoint save into {tmp} failed: {exc}{hidden}. {space} The tmp dir was "
            f"removed; earlier published steps in {self.layout.steps_dir} are untouched."
        ) from exc

    def _space_report(self) -> str:
        """Write errors from torch DCP often hide ENOSPC; say how full the disk is."""
        usage = shutil.disk_usage(self.layout.steps_dir)
        mib = 1 << 20
        report = (
            f"Filesystem of {self.layout.steps_dir}: {usage.free // mib} MiB free of "
            f"{usage.total // mib} MiB."
        )
        if usage.free < 0.05 * usage.total:
            report += " The disk is (nearly) full: free space or lower checkpoint.keep_last."
        return report

    # ------------------------------------------------------------- restore
    def restore(
        self,
        step_dir: Path,
        manifest: Manifest,
        same_layout: bool,
        early: EarlyLoad | None = None,
    ) -> int:
        """Load a step chosen, topology-validated and re-hashed by restore/plan.py;
        ``early``: its shards, read already while its files were re-hashed."""
        if early is None:  # an early read met train.fault's restore point already
            self.faults.at_checkpoint("restore", manifest.step)
        started = time.perf_counter() - (early.seconds if early else 0.0)
        cfg, train_state = self.cfg, state_io.read_train_state(step_dir)
        if manifest.weights_only:
            # Imported: nothing was trained at its recorded batch or schedule; this run's
            # optimizer starts fresh on this run's own schedule and batch.
            self.cfg = replace(cfg, load_optimizer=False, schedule_on_resume="config")
            train_state["global_batch_size"] = self.trainer.parts.plan.global_batch_size
        try:
            loaded = self._shards(step_dir, manifest, self.cfg, early)
            rank_state = state_io.load_rank_state(step_dir, self.rank) if same_layout else None
            startup_clock.mark("restore_read")
            self.apply_loaded(
                loaded,
                train_state,
                rank_state,
                step_dir.name,
                restored=(manifest.step, "persistent"),
                started=started,
            )
        finally:
            self.cfg = cfg
        return manifest.step

    def _shards(
        self, step_dir: Path, manifest: Manifest, cfg: CheckpointConfig, early: EarlyLoad | None
    ) -> dict[str, Any]:
        """The step's shards: those the early read brought already, or read now."""
        if early is not None and early.error is not None:
            raise early.error  # the files re-hashed fine: the load's own failure
        if early is not None:
            return early.loaded
        return read_shards(self.trainer.parts, step_dir, manifest, cfg).loaded

    def _load_chunks(self, loaded: dict[str, Any]) -> None:
        """The model chunks' weights, strictly (every parameter the checkpoint's)."""
        for key, chunk in chunks_by_key(self.trainer.parts.chunks).items():
            chunk.load_state_dict(loaded[key], strict=True)

    def warm_start(
        self,
        step_dir: Path,
        manifest: Manifest,
        with_optimizer: bool,
        early: EarlyLoad | None = None,
    ) -> None:
        """checkpoint.init_from: another run's step, verified and validated by restore/plan.py,
        loaded as this run's step 0: its weights (and with ``with_optimizer`` its optimizer
        state); the step, data cursor, schedule and RNG stay this run's fresh ones."""
        if early is None:
            self.faults.at_checkpoint("restore", manifest.step)
        started = time.perf_counter() - (early.seconds if early else 0.0)
        cfg = replace(self.cfg, load_optimizer=with_optimizer)
        loaded = self._shards(step_dir, manifest, cfg, early)
        startup_clock.mark("restore_read")
        parts = self.trainer.parts
        self._load_chunks(loaded)
        if with_optimizer:
            saved = state_io.read_train_state(step_dir)["scheduler"]
            load_optimizer_keeping_schedule(parts.optimizer, loaded["optimizer"], saved)
            if not self._optimizer_has_state():
                raise RestoreError(f"optimizer state is empty after loading {step_dir}")
        else:
            # Main (fp32) params were copied from the weights at build time; refresh them.
            parts.optimizer.reload_model_params()
        log.log(
            logging.INFO if self.rank == 0 else logging.DEBUG,
            "warm start: %s of run %r loaded (%s) in %.2f s; training starts at step 0 with "
            "this run's schedule and data",
            step_dir.name,
            manifest.run_id,
            "weights and optimizer state" if with_optimizer else "weights, fresh optimizer",
            time.perf_counter() - started,
        )
        startup_clock.mark("restore_load")

    def apply_loaded(
        self,
        loaded: dict[str, Any],
        train_state: dict[str, Any],
        rank_state: dict[str, Any] | None,
        source: str,
        restored: tuple[int, str],
        started: float | None = None,
    ) -> None:
        """Put loaded shards, loop state and RNG (None: topology changed, reseed) in place;
        ``restored``: the (step, tier) this run now continues from."""
        trainer = self.trainer
        breaks = self.faults.restore_breaks(train_state["step"])  # the gate's controls only
        self._load_chunks(loaded)
        override = self.cfg.schedule_on_resume == "config"
        if self.cfg.load_optimizer:
            if override:  # megatron 0.19 pairs saved and live groups by their max/min LR
                set_group_lrs(
                    trainer.parts.optimizer,
                    train_state["scheduler"]["max_lr"],
                    train_state["scheduler"]["min_lr"],
                )
            trainer.parts.optimizer.load_state_dict(loaded["optimizer"])
        else:
            # Main (fp32) params were copied from the weights at build time; refresh them.
            trainer.parts.optimizer.reload_model_params()
            log.warning(
                "restore: weights only (checkpoint.load_optimizer=false, or a step imported "
                "from transformers), FRESH optimizer state: the loss trajectory is not the "
                "one an optimizer restored with the weights would give"
            )
        if override:
            schedule_from_config(trainer.parts, trainer.run.optimizer)
        scaling = scale_lr_for_batch_change(
            trainer.parts, train_state, self.cfg.batch_change_lr_scaling
        )
        self.lr_scaling = scaling or self.lr_scaling
        trainer.parts.scheduler.load_state_dict(train_state["scheduler"])
        load_s = None if started is None else time.perf_counter() - started
        trainer.load_state_dict(broken.cursor_dropped(train_state, breaks), load_s=load_s)
        if rank_state is not None:
            state_io.restore_rng(rank_state, trainer.env.device)
        else:
            seed = state_io.reseed_rng(trainer.run.train.seed, train_state["step"], self.rank)
            log.warning(
                "restore: topology changed; RNG reseeded from (seed, step, rank) = %d", seed
            )
        broken.break_restored(trainer.parts.chunks, trainer.parts.optimizer, breaks)
        self._check_restored(train_state, lr_saved=not override)
        self._check_fingerprint(rank_state)
        log.info(
            "restore: resumed from %s at step %d (%d samples consumed)",
            source,
            train_state["step"],
            trainer.state.consumed_samples,
        )
        self.restored_step, self.restored_tier = restored
        startup_clock.mark("restore_load")

    def _check_restored(self, train_state: dict[str, Any], lr_saved: bool = True) -> None:
        """The loop state is the saved one; so is the LR, unless this run's schedule won."""
        trainer = self.trainer
        problems = []
        if trainer.state.step != train_state["step"]:
            problems.append(f"step {trainer.state.step} != saved step {train_state['step']}")
        lr = trainer.lr
        if lr_saved and not math.isclose(lr, train_state["lr"], rel_tol=1e-9, abs_tol=1e-15):
            problems.append(f"lr {lr} != saved lr {train_state['lr']}")
        if self.cfg.load_optimizer and not self._optimizer_has_state():
            problems.append("optimizer state is empty after load")
        if problems:
            raise RestoreError(
                f"restored state does not match step {train_state['step']}: " + "; ".join(problems)
            )

    def _check_fingerprint(self, rank_state: dict[str, Any] | None) -> None:
        """checkpoint.fingerprint: the live state after the load is the state the save saw
        (same layout and the optimizer loaded; otherwise the rank's tensors differ by design)."""
        saved = (rank_state or {}).get(FINGERPRINT_KEY)
        if not self.cfg.fingerprint or saved is None or not self.cfg.load_optimizer:
            return
        parts = self.trainer.parts
        wrong = differences(saved, state_fingerprint(parts.chunks, parts.optimizer))
        if wrong:
            shown = "; ".join(wrong[:5]) + (
                f"; and {len(wrong) - 5} more" if len(wrong) > 5 else ""
            )
            raise RestoreError(
                f"restored state differs from the saved one in {len(wrong)} of {len(saved)} "
                f"tensors (rank {self.rank}): {shown}"
            )
        log.info("restore: state fingerprint matches the save (%d tensors)", len(saved))

    def _optimizer_has_state(self) -> bool:
        optimizer = self.trainer.parts.optimizer
        inner = [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])]
        return all(any(len(s) > 0 for s in o.state.values()) for o in inner)

    def close(self) -> None:
        self._join_gc()
        if self.queue is None:
            return
        queue, self.queue = self.queue, None
        try:
            queue.close()  # finalizes what is still in flight
        except SAVE_ERRORS as exc:
            # The run is ending (a failure, often the same full disk, stopped it before this
            # save's writer reported): the save's tmp dir goes, the published steps stay, and
            # the hooks after this one (the attempt record, the lease) still close.
            pending, self.pending = self.pending, None
            if pending is not None:
                shutil.rmtree(pending.tmp_dir, ignore_errors=True)
            log.error(
                "checkpoint: the save in flight failed as the run ended (%s); its tmp dir "
                "was removed, the published steps are untouched",
                str(exc).splitlines()[0][:300],
            )
