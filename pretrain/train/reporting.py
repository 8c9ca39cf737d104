"""TensorBoard and Weights & Biases: the run's scalars, written by rank 0 (it holds the reduced
loss), one curve per run across restarts and requeues.

TensorBoard: event files in ``<run_dir>/tensorboard``. A restarted attempt starts its file with
TensorBoard's purge marker at the restored step + 1, so TensorBoard drops the steps the failed
attempt logged after that checkpoint: the curve has each step once. W&B: the run id is the W&B
run id (``resume="allow"``), so a restart continues the same run; ``mode=offline`` by default.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pretrain.context.run_dir import RunDir
from pretrain.train.hooks import EvalResult, StepResult, TrainHook

if TYPE_CHECKING:
    from pretrain.train.trainer import Trainer
    from recipes.config.logging import LoggingConfig
    from recipes.config.run import RunConfig

log = logging.getLogger(__name__)
RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"
BATCH_EVENTS, BATCH_S = 20, 5.0  # TensorBoard steps written (and flushed) at once


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

    def on_report(self, trainer: "Trainer", scalars: dict[str, float], step: int) -> None:
        self.write(scalars, step)

    def on_checkpoint_begin(self, trainer: "Trainer", what: str) -> None:
        self.blocked_since = time.perf_counter()

    def on_checkpoint_end(self, trainer: "Trainer", what: str) -> None:
        if self.blocked_since is not None:
            blocked = time.perf_counter() - self.blocked_since
            self.write({"checkpoint/save_blocked_s": blocked}, trainer.state.step)
        self.blocked_since = None


class EventFile:
    """A TensorBoard event file written from the training thread, in batches.

    tensorboard's own writers (and torch's SummaryWriter on top of them) hand every event to a
    writer thread through a 10-slot queue; that thread serializes and CRCs in Python and takes
    the GIL to do so, which on a busy host is the step's time (P5: 2 % of a tiny step). The
    records are still written by tensorboard's ``RecordWriter`` and protos, so the format is
    theirs; only the thread is gone. TensorBoard itself flushes every 2 minutes; this flushes
    each batch.
    """

    def __init__(self, logdir: Path, purge_step: int) -> None:
        # tensorboard: loaded only when enabled (0.3 s of imports)
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.record_writer import RecordWriter

        self.pb, self.summary_pb = event_pb2, summary_pb2
        logdir.mkdir(parents=True, exist_ok=True)
        name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.0"
        self.records = RecordWriter(open(logdir / name, "wb"))  # noqa: SIM115 - closed in close()
        self.write(event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2"))
        # Steps >= purge_step logged by a failed attempt are redone by this one: TensorBoard
        # drops the earlier ones when it reads this marker.
        start = event_pb2.SessionLog(status=event_pb2.SessionLog.START)
        self.write(event_pb2.Event(wall_time=time.time(), step=purge_step, session_log=start))
        self.flush()

    def write(self, event: Any) -> None:
        self.records.write(event.SerializeToString())

    def scalars(self, scalars: dict[str, float], step: int, wall_time: float) -> None:
        """One event holding every scalar of ``step``."""
        summary = self.summary_pb.Summary(
            value=[
                self.summary_pb.Summary.Value(tag=k, simple_value=float(v))
                for k, v in scalars.items()
            ]
        )
        self.write(self.pb.Event(wall_time=wall_time, step=step, summary=summary))

    def flush(self) -> None:
        self.records.flush()

    def close(self) -> None:
        self.records.close()


class TensorBoardHook(ScalarHook):
    def __init__(self, run_dir: Path) -> None:
        super().__init__()
        self.dir = RunDir(run_dir).tensorboard_dir
        self.events: EventFile | None = None
        self.batch: list[tuple[dict[str, float], int, float]] = []
        self.handed = time.monotonic()

    def on_start(self, trainer: "Trainer") -> None:
        self.events = EventFile(self.dir, purge_step=trainer.state.step + 1)
        self._opened()

    def _write(self, scalars: dict[str, float], step: int) -> None:
        self.batch.append((scalars, step, time.time()))
        if len(self.batch) >= BATCH_EVENTS or time.monotonic() - self.handed >= BATCH_S:
            self._flush()

    def _flush(self) -> None:
        if self.events is None:
            return
        for scalars, step, wall_time in self.batch:
            self.events.scalars(scalars, step, wall_time)
        self.events.flush()
        self.batch, self.handed = [], time.monotonic()

    def on_eval_end(self, trainer: "Trainer", result: EvalResult) -> None:
        super().on_eval_end(trainer, result)
        self._flush()

    def on_end(self, trainer: "Trainer") -> None:
        self._flush()

    def close(self) -> None:
        if self.events is not None:
            self._flush()  # a failing run keeps what it logged
            self.events.close()
            self.events = None


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
