"""Preemption and Ctrl-C: an emergency persistent save at the next step boundary, then exit.

SIGTERM/SIGUSR1 (a time limit, a preemption, a pod's deletion) end with REQUEUE; a Ctrl-C
(SIGINT, pretrain/context/interrupts.py) ends with INTERRUPTED: the user stopped the run, no
launcher requeues or retries it.

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
        if result.interrupted:  # a Ctrl-C on any rank: every rank ends as the user asked
            code, why, then = exit_codes.INTERRUPTED, "Ctrl-C", "stop"
        else:
            name = signal.Signals(self.received).name if self.received else "a peer's signal"
            code, why, then = exit_codes.REQUEUE, f"preemption ({name})", "requeue"
        if trainer.env.rank == 0:
            again = "; Ctrl-C again to stop at once without it" if then == "stop" else ""
            log.warning("%s: emergency save at step %d, then exit %d (%s)%s", why,
                        trainer.state.step, code, then, again)  # fmt: skip
        watchdog = threading.Timer(self.timeout_s, self._give_up, args=(code,))
        watchdog.daemon = True
        watchdog.start()
        try:
            self.checkpoint.save_now(trainer)
        finally:
            watchdog.cancel()
        reason = "interrupted by the user" if then == "stop" else f"preempted ({name})"
        trainer.request_stop(code, f"{reason}, emergency save done")

    def _give_up(self, code: int) -> None:
        log.error(
            "emergency save exceeded %.0f s; exiting %d without it (the last published "
            "step is intact)",
            self.timeout_s,
            code,
        )
        os._exit(code)

    def close(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
