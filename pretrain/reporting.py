"""TensorBoard and Weights & Biases: the run's scalars, written by rank 0 (it holds the reduced
loss), one curve per run across restarts and requeues.

TensorBoard: event files in ``<run_dir>/tensorboard``. A restarted attempt opens its writer with
``purge_step`` = the restored step + 1, so TensorBoard drops the steps the failed attempt logged
after that checkpoint: the curve has each step once. W&B: the run id is the W&B run id
(``resume="allow"``), so a restart continues the same run; ``mode=offline`` by default.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pretrain.hooks import EvalResult, StepResult, TrainHook

if TYPE_CHECKING:
    from pretrain.loop import Trainer
    from recipes.schema import LoggingConfig, RunConfig

log = logging.getLogger(__name__)
TENSORBOARD_DIR = "tensorboard"
RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"


def step_scalars(trainer: "Trainer", result: StepResult) -> dict[str, float]:
    """The per-step scalars every backend writes (names as Megatron-LM's TensorBoard)."""
    scalars = {
        "train/loss": result.loss,
        "train/lr": result.lr,
        "train/grad_norm": result.grad_norm,
        "throughput/tokens_per_s": result.tokens_per_s,
        "throughput/step_time_s": result.step_time_s,
        "throughput/tflops_per_device": result.tflops_per_device,
        "train/batch_size": float(trainer.parts.plan.global_batch_size),
        "train/consumed_tokens": float(trainer.state.consumed_tokens),
        "run/restarts": float(os.environ.get(RESTART_ENV, "0") or 0),
    }
    if result.mfu is not None:
        scalars["throughput/mfu"] = result.mfu
    for key, value in (result.memory_gib or {}).items():
        scalars[f"memory/{key}"] = value
    return scalars


def eval_scalars(result: EvalResult) -> dict[str, float]:
    return {
        f"{result.split}/loss": result.loss,
        f"{result.split}/perplexity": math.exp(min(result.loss, 80.0)),
    }


class ScalarHook(TrainHook):
    """Collects scalars from the loop's events; a backend writes them."""

    def __init__(self) -> None:
        self.blocked_since: float | None = None
        self.ready = False
        self.pending: list[tuple[dict[str, float], int]] = []  # events before on_start

    def write(self, scalars: dict[str, float], step: int) -> None:
        if not self.ready:  # e.g. a restore's load time: the checkpoint hook's on_start
            self.pending.append((scalars, step))
            return
        self._write(scalars, step)

    def _write(self, scalars: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def _opened(self) -> None:
        self.ready = True
        for scalars, step in self.pending:
            self._write(scalars, step)
        self.pending = []

    def after_step(self, trainer: "Trainer", result: StepResult) -> None:
        self.write(step_scalars(trainer, result), result.step)

    def on_eval_end(self, trainer: "Trainer", result: EvalResult) -> None:
        self.write(eval_scalars(result), result.step)

    def on_resumed(self, trainer: "Trainer", load_s: float) -> None:
        self.write({"checkpoint/load_s": load_s}, trainer.state.step)

    def on_checkpoint_begin(self, trainer: "Trainer", what: str) -> None:
        self.blocked_since = time.perf_counter()

    def on_checkpoint_end(self, trainer: "Trainer", what: str) -> None:
        if self.blocked_since is not None:
            blocked = time.perf_counter() - self.blocked_since
            self.write({"checkpoint/save_blocked_s": blocked}, trainer.state.step)
        self.blocked_since = None


class TensorBoardHook(ScalarHook):
    def __init__(self, run_dir: Path) -> None:
        super().__init__()
        self.dir = run_dir / TENSORBOARD_DIR
        self.writer: Any = None

    def on_start(self, trainer: "Trainer") -> None:
        # tensorboard: loaded only when enabled (0.5 s of imports)
        from torch.utils.tensorboard import SummaryWriter

        # Steps after the restored one were logged by the failed attempt and are redone now.
        self.writer = SummaryWriter(str(self.dir), purge_step=trainer.state.step + 1)
        self._opened()

    def _write(self, scalars: dict[str, float], step: int) -> None:
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, step)

    def on_end(self, trainer: "Trainer") -> None:
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class WandbHook(ScalarHook):
    def __init__(self, run: "RunConfig", run_dir: Path) -> None:
        super().__init__()
        self.run, self.run_dir = run, run_dir
        self.wandb: Any = None

    def on_start(self, trainer: "Trainer") -> None:
        # wandb: an optional extra (pip install -e '.[wandb]'), loaded only when enabled
        import wandb

        cfg = self.run.logging.wandb
        wandb.init(
            project=cfg.project,
            entity=cfg.entity,
            name=cfg.name or self.run.run_id,
            group=cfg.group,
            id=self.run.run_id,  # one W&B run per run: a restart continues it
            resume="allow",
            mode=cfg.mode,
            dir=str(self.run_dir),
            config=dataclasses.asdict(self.run),
        )
        self.wandb = wandb
        self._opened()

    def _write(self, scalars: dict[str, float], step: int) -> None:
        self.wandb.log(scalars, step=step)

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()


def reporting_hooks(run: "RunConfig", rank: int, run_dir: Path) -> list[TrainHook]:
    """The enabled backends on the rank that writes (rank 0); none elsewhere."""
    cfg: LoggingConfig = run.logging
    if rank != 0:
        return []
    hooks: list[TrainHook] = []
    if cfg.tensorboard:
        hooks.append(TensorBoardHook(run_dir))
    if cfg.wandb.enabled:
        hooks.append(WandbHook(run, run_dir))
    return hooks
