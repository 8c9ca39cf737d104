"""Monitoring hooks around the checkpoint hooks: each is absent when its feature is off."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from pretrain.loop import TrainHook
from resiliency.ft import FaultToleranceHook, under_ft_launcher
from resiliency.ft_evidence import AttemptEvidenceHook
from resiliency.hooks import CheckpointHook

if TYPE_CHECKING:
    from pretrain.distributed import DistEnv
    from recipes.schema import RunConfig


def with_monitoring(run: "RunConfig", env: "DistEnv", run_dir: Path,
                    hooks: list[TrainHook]) -> list[TrainHook]:
    """``hooks`` with the evidence and FT hooks in front and the observers behind.

    In front: their ``configure`` runs before the checkpoint hook's lease and restore planning
    (the FT "setup" section and the startup clock must already run then). Behind: they read
    what the checkpoint hook restored and saved.
    """
    cfg = run.resiliency
    checkpoint = next((h for h in hooks if isinstance(h, CheckpointHook)), None)
    evidence = (AttemptEvidenceHook(env, run_dir, checkpoint, cfg.ft.check_interval_s)
                if checkpoint else None)
    front: list[TrainHook] = [evidence] if evidence else []
    if under_ft_launcher():
        front.append(FaultToleranceHook(cfg.ft, env, run_dir, checkpoint))
    back: list[TrainHook] = []
    straggler = None
    if cfg.straggler.enabled:
        from resiliency.straggler import StragglerHook

        straggler = StragglerHook(cfg.straggler, env, run_dir)
        back.append(straggler)
    if cfg.metrics.enabled and env.rank == 0:
        from resiliency.metrics import MetricsHook

        back.append(MetricsHook(cfg.metrics, run.run_id, run_dir, checkpoint, evidence, straggler))
    if checkpoint is not None and cfg.watch.steps:
        from resiliency.watch import PostRestoreWatchHook

        back.append(PostRestoreWatchHook(cfg.watch, env.rank, run_dir, checkpoint))
    return front + hooks + back
