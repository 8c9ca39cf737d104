"""checkpoint.dump_state_at: every rank writes its whole state (state_dump.py) at the listed
steps, before the next step trains: where an uninterrupted run stands after step N and where a
run restored from step N starts are the same moment of the loop."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from pretrain.train.hooks import StepResult, TrainHook
from resiliency.checkpoint.equivalence import state_dump

if TYPE_CHECKING:
    from pretrain.train.view import TrainerView

log = logging.getLogger(__name__)


class StateDumpHook(TrainHook):
    def __init__(self, steps: list[int], root: Path, rank: int) -> None:
        self.steps, self.root, self.rank = set(steps), root, rank
        self.trained: int | None = None  # the step this process trained last

    def after_step(self, trainer: TrainerView, result: StepResult) -> None:
        self.trained = result.step

    def before_step(self, trainer: TrainerView) -> None:
        step = trainer.state.step
        path = state_dump.dump_path(self.root, step, self.rank)
        if step not in self.steps or path.exists():
            return
        grads_of = step if self.trained == step else None
        state_dump.write(state_dump.capture(trainer, grads_of), path)
        log.log(
            logging.INFO if self.rank == 0 else logging.DEBUG,
            "state dump: step %d written to %s",
            step,
            path.parent,
        )
