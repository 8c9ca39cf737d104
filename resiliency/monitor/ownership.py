"""The run's ownership as hooks: take the lease and claim the attempt before anything reads the
run dir, record how the attempt went, and let go once the checkpointer is done.

Two hooks share one :class:`RunContext`, because taking and letting go sit at different places
in the hook list: :class:`OwnershipHook` runs before the checkpoint hook (its restore planning
needs the attempt id under the lease), :class:`OwnershipEndHook` after it (the final save is
published under the lease, and only then is the attempt "finished").
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pretrain.context import exit_codes
from pretrain.context.failures import classify
from pretrain.platform.distributed import probe_ranks
from pretrain.train.hooks import StepResult, TrainHook
from resiliency.monitor.health import HEALTH_DIR_ENV, read_reports

if TYPE_CHECKING:
    from pretrain.platform.distributed import DistEnv
    from pretrain.train.view import TrainerView
    from recipes.config.run import RunConfig
    from resiliency.run_context import RunContext

log = logging.getLogger(__name__)


class OwnershipHook(TrainHook):
    """Probes every rank, takes the lease, claims the attempt; watches for a takeover;
    records the attempt's start, its guard events and its failure."""

    def __init__(self, ctx: RunContext, env: DistEnv) -> None:
        self.ctx, self.env = ctx, env
        self.health: dict[str, Any] | None = None  # the startup probe and node reports

    def configure(self, run: RunConfig, dp: int) -> RunConfig:
        self.health = _probe(run)
        self.ctx.acquire(self.env.rank, self.env.world_size)
        return run

    def on_start(self, trainer: TrainerView) -> None:
        self.ctx.record("running", health=self.health)

    def wants_stop(self, trainer: TrainerView) -> bool:
        return self.ctx.lost is not None  # rank 0's heartbeat saw a takeover

    def after_step(self, trainer: TrainerView, result: StepResult) -> None:
        """A stop was voted: if it is because the lease was taken over, this attempt writes
        nothing more (the hooks after this one read ``ctx.fenced``) and leaves with exit 6,
        the new owner named."""
        if not result.stop_asked or self.ctx.fenced is not None:
            return
        lost = self.ctx.lost_everywhere()  # collective: every rank voted alike
        if lost is not None:
            self.ctx.fenced = lost
            trainer.request_stop(exit_codes.LEASE_HELD, lost)

    def on_anomaly(self, trainer: TrainerView, result: StepResult, action: str) -> None:
        """The guard's run totals and this attempt's events go into the attempt record."""
        self.ctx.update(guard=trainer.guard_record())

    def on_exception(self, trainer: TrainerView | None, exc: BaseException) -> None:
        failure = classify(exc)
        fields = {
            "step": trainer.state.step if trainer is not None else None,
            "exit_code": failure.exit_code,
            "failure_class": failure.kind,
            "error": failure.message[:2000],
        }
        status = {"lease": "fenced", "interrupted": "interrupted"}.get(failure.kind, "failed")
        try:
            self.ctx.record(status, **fields)
        except OSError:
            # The disk that failed the run is full, perhaps with a save in flight: the end
            # hook writes the record again once the checkpointer has closed (and removed it).
            self.ctx.pending_record = (status, fields)
            raise


class OwnershipEndHook(TrainHook):
    """After the checkpoint hook: the attempt's end status once its ``on_end`` ran (the final
    save included), and the lease released once it closed (the checkpointer's last writes)."""

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx

    def on_end(self, trainer: TrainerView) -> None:
        if self.ctx.ended:
            return
        if self.ctx.fenced is not None:
            status = "fenced"
        elif trainer.exit_code == exit_codes.REQUEUE:
            status = "preempted"
        elif trainer.exit_code == exit_codes.INTERRUPTED:
            status = "interrupted"
        else:
            status = "finished"
        self.ctx.record(status, step=trainer.state.step, exit_code=trainer.exit_code)

    def close(self) -> None:
        pending, self.ctx.pending_record = self.ctx.pending_record, None
        try:
            if pending is not None:
                status, fields = pending
                self.ctx.record(status, **fields)  # a failure here is logged by the session
                log.info("attempt record: the failure written once the checkpointer closed")
        finally:
            self.ctx.release()


def _probe(run: RunConfig) -> dict[str, Any] | None:
    """Every rank answers one timed collective before the lease and the restore; the
    launcher's node reports (if it ran the check) go into the attempt record with it."""
    if not run.resiliency.health.enabled:
        return None
    probe = probe_ranks(run.resiliency.health.allreduce_timeout_s)
    reports = os.environ.get(HEALTH_DIR_ENV)
    return {**probe, "nodes": read_reports(Path(reports)) if reports else None}
