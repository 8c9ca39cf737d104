"""What a hook sees of the Trainer: a bounded, documented view (Megatron-Bridge's callback
context), and the data it holds.

Hooks, the checkpointer and the benchmarks are typed against :class:`TrainerView`, never the
Trainer class: they read what is listed here and change the loop only through its methods
(``request_stop``, ``checkpointing``, ``load_state_dict``, ``rebuild``, ``run_steps``). Only
``pretrain.train`` imports the concrete Trainer (an import-linter contract).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from pretrain.data.dataset import BatchPlan
    from pretrain.platform.distributed import DistEnv
    from pretrain.train.fault_injection import FaultInjector
    from recipes.config.run import RunConfig


@dataclass
class TrainState:
    """Loop position saved with every checkpoint."""

    step: int = 0
    consumed_samples: int = 0
    consumed_tokens: int = 0


@dataclass
class Components:
    """What the Trainer built for one run: model chunks (and their DDP wrappers), optimizer,
    LR scheduler, data, tokenizer and batch plan. Rebuilt as a whole (``rebuild``)."""

    tcfg: Any
    chunks: list[Any]
    ddp: list[Any]
    optimizer: Any
    scheduler: Any
    dataset: Any
    tokenizer: Any
    plan: BatchPlan
    padded_vocab: int
    eval_data: dict[str, Any]  # held-out splits by name ("valid", "test"); empty: no eval


class TrainerView(Protocol):
    """The Trainer as hooks may use it. Attributes are read-only to them."""

    @property
    def run(self) -> RunConfig:
        """The config being trained (after every hook's ``configure``)."""

    @property
    def env(self) -> DistEnv:
        """This process's rank, world size and device."""

    @property
    def dp(self) -> int:
        """Data-parallel size."""

    @property
    def run_dir(self) -> Path:
        """``<output_dir>/<run_id>`` (names of its entries: :mod:`pretrain.context.run_dir`)."""

    @property
    def state(self) -> TrainState:
        """The loop position: steps done, samples and tokens consumed."""

    @property
    def parts(self) -> Components:
        """The model chunks, optimizer, scheduler, data and tokenizer."""

    @property
    def faults(self) -> FaultInjector:
        """Test-only fault injection (``train.fault``): checkpoint code calls its points."""

    @property
    def lr(self) -> float:
        """The learning rate of the step that ran last."""

    @property
    def tokens_per_step(self) -> int: ...

    @property
    def exit_code(self) -> int:
        """The planned exit code (``request_stop``); 0 otherwise."""

    @property
    def stop_requested(self) -> bool: ...

    def request_stop(self, exit_code: int, reason: str) -> None:
        """A planned exit before the next step, with ``exit_code``."""

    def checkpointing(self, what: str) -> AbstractContextManager[None]:
        """Wrap checkpoint work so every hook sees ``on_checkpoint_begin``/``_end``."""

    def checkpoint_phase(self, phase: str) -> None:
        """A new phase of the checkpoint work in progress (``"commit"``)."""

    def report(self, scalars: dict[str, float], step: int) -> None:
        """Run-level scalars for the run's reports (every hook's ``on_report``)."""

    def rebuild(self, run: RunConfig) -> None:
        """Build model, optimizer and data anew for ``run``, as a fresh start would."""

    def state_dict(self) -> dict[str, Any]:
        """The loop state a checkpoint carries beside the shards: position, schedule, the
        numeric guard's window, and every stateful hook's state under its ``state_key``."""

    def load_state_dict(self, record: dict[str, Any], load_s: float | None = None) -> None:
        """Continue from a checkpoint's ``state_dict``; ``load_s``: how long the restore took
        (hooks see it in ``on_resumed``)."""

    def guard_record(self) -> dict[str, Any]:
        """The numeric guard's totals and this attempt's events, for the attempt record."""

    def train_step(self) -> Any:
        """One training step without hooks, faults or logging (a StepResult): benchmarks."""

    def run_steps(self, n: int, hooks: list[Any] | None = None) -> None:
        """Run ``n`` more steps of the loop (with ``hooks``, TrainHook objects, instead of the
        run's, if given): how benchmarks drive the product loop without touching its fields.
        (Typed loosely: the hook API module imports this one, not the other way round.)"""
