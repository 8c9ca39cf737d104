"""Preemption: SIGTERM/SIGUSR1 -> emergency persistent save at the next step boundary -> REQUEUE.

The handler only sets a flag; ranks agree on it at the end of every step, in the same
all-reduce as the step's loss (``TrainHook.wants_stop``), so every rank saves at the same step
even if the signal reached only some of them, and the check costs no collective of its own.
The save is bounded: past ``emergency_save_timeout_s`` the process exits with REQUEUE anyway
(the last published step is still intact), so a Terminating pod or a Slurm grace period is
never overrun.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import TYPE_CHECKING, Any

from pretrain.context import exit_codes
from pretrain.train.hooks import TrainHook

if TYPE_CHECKING:
    from pretrain.train.hooks import StepResult
    from pretrain.train.view import TrainerView
    from resiliency.checkpoint.hook import CheckpointHook

log = logging.getLogger(__name__)
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class PreemptionHook(TrainHook):
    def __init__(self, checkpoint: "CheckpointHook", timeout_s: float) -> None:
        self.checkpoint, self.timeout_s = checkpoint, timeout_s
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def on_start(self, trainer: "TrainerView") -> None:
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.received = signum

    def wants_stop(self, trainer: "TrainerView") -> bool:
        return self.received is not None

    def after_step(self, trainer: "TrainerView", result: "StepResult") -> None:
        # The last step ends the run anyway (and on_end saves it): nothing to requeue. A stop
        # another hook already decided (a lease taken over: exit 6) saves nothing either.
        if not result.stop_asked or trainer.stop_requested:
            return
        if trainer.state.step >= trainer.run.train.train_steps:
            return
        name = signal.Signals(self.received).name if self.received else "a peer's signal"
        log.warning(
            "preemption (%s): emergency save at step %d, then exit %d (requeue)",
            name,
            trainer.state.step,
            exit_codes.REQUEUE,
        )
        watchdog = threading.Timer(self.timeout_s, self._give_up)
        watchdog.daemon = True
        watchdog.start()
        try:
            self.checkpoint.save_now(trainer)
        finally:
            watchdog.cancel()
        trainer.request_stop(exit_codes.REQUEUE, f"preempted ({name}), emergency save done")

    def _give_up(self) -> None:
        log.error(
            "emergency save exceeded %.0f s; exiting %d without it (the last published "
            "step is intact)",
            self.timeout_s,
            exit_codes.REQUEUE,
        )
        os._exit(exit_codes.REQUEUE)

    def close(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
