"""Every resiliency feature as train-loop hooks, in the order they must run; each hook is absent
(not just idle) when its feature is off. Registered with the trainer through the
``mcore_recipes.train_hooks`` entry point (pyproject.toml), so the core never imports this."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from pretrain.train.hooks import TrainHook
from resiliency.checkpoint.equivalence.hook import StateDumpHook
from resiliency.checkpoint.hook import CheckpointHook, CheckpointPreflight
from resiliency.monitor.evidence import AttemptEvidenceHook
from resiliency.monitor.fault_tolerance import FaultToleranceHook, under_ft_launcher
from resiliency.monitor.metrics import MetricsHook
from resiliency.monitor.ownership import OwnershipEndHook, OwnershipHook
from resiliency.monitor.preemption import PreemptionHook
from resiliency.monitor.straggler import StragglerHook
from resiliency.monitor.watch import PostRestoreWatchHook
from resiliency.run_context import RunContext
from resiliency.storage.layout import RunLayout

if TYPE_CHECKING:
    from pretrain.platform.distributed import DistEnv
    from recipes.config.run import RunConfig


def build_hooks(run: RunConfig, env: DistEnv, run_dir: Path) -> list[TrainHook]:
    """The run's resiliency hooks, in order; all of them share one run context.

    In front, the evidence and FT hooks: their ``configure`` runs before the lease and the
    restore planning (the FT "setup" section and the startup clock must already run then);
    then the ownership hook takes the lease and claims the attempt, so the checkpoint hook
    plans its restore under it. Behind, the observers: they read what was restored and saved.
    Between them, the ownership end hook: the attempt's end status after the final save (so
    the observers' end-of-run goodput counts it), the lease released after the checkpointer
    closed.
    """
    cfg = run.resiliency
    ctx = RunContext(RunLayout(run_dir.parent, run.run_id), run.checkpoint.lease_timeout_s)
    evidence = AttemptEvidenceHook(env, run_dir, ctx, cfg.ft.check_interval_s)
    front: list[TrainHook] = [evidence]
    if under_ft_launcher():
        remote = run.checkpoint.remote if run.checkpoint.enabled and run.checkpoint.resume else None
        front.append(FaultToleranceHook(cfg.ft, env, run_dir, ctx, remote))
    if run.checkpoint.enabled:  # no-model checks of the checkpoint settings, before the lease
        front.append(CheckpointPreflight(run.checkpoint, env))
    front.append(OwnershipHook(ctx, env))
    checkpoint = CheckpointHook(run, env, ctx) if run.checkpoint.enabled else None
    middle: list[TrainHook] = []
    if checkpoint is not None:
        middle.append(checkpoint)
        if cfg.preemption:
            middle.append(PreemptionHook(checkpoint, cfg.emergency_save_timeout_s))
    back: list[TrainHook] = []
    straggler = StragglerHook(cfg.straggler, env, run_dir) if cfg.straggler.enabled else None
    if straggler is not None:
        back.append(straggler)
    if cfg.metrics.enabled and env.rank == 0:
        back.append(MetricsHook(cfg.metrics, run.run_id, ctx, checkpoint, evidence, straggler))
    if checkpoint is not None and cfg.watch.steps:
        back.append(PostRestoreWatchHook(cfg.watch, env.rank, run_dir, ctx))
    if run.checkpoint.dump_state_at:  # last: it dumps what every other hook left in place
        dumps = Path(run.checkpoint.dump_state_dir or "")
        back.append(StateDumpHook(run.checkpoint.dump_state_at, dumps, env.rank))
    return front + middle + [OwnershipEndHook(ctx)] + back
