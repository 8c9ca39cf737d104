"""Test-only fault injection, driven by ``train.fault`` ("<kind>@<step>[:<rank>]", ';'-separated).

Kinds: kill (SIGKILL self before the step), hang (block forever), raise (deterministic
exception), nan (poison gradients after backward), kill_save (SIGKILL once this step's shards
are written, before the commit), kill_publish (SIGKILL after COMMITTED is written, before the
rename). Empty in every shipped recipe.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)
KINDS = ("kill", "hang", "raise", "nan", "kill_save", "kill_publish")


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    rank: int | None


class InjectedFault(RuntimeError):
    """The deterministic user-code failure raised by ``raise@N``."""


class FaultInjector:
    def __init__(self, faults: list[Fault], rank: int) -> None:
        self.faults = [f for f in faults if f.rank is None or f.rank == rank]

    @classmethod
    def parse(cls, spec: str, rank: int) -> "FaultInjector":
        faults = []
        for item in filter(None, (part.strip() for part in spec.split(";"))):
            kind, _, where = item.partition("@")
            step, _, on_rank = where.partition(":")
            if kind not in KINDS or not step.isdigit() or (on_rank and not on_rank.isdigit()):
                raise ValueError(f"train.fault: bad entry {item!r}; expected <kind>@<step>[:<rank>] "
                                 f"with kind in {KINDS}")
            faults.append(Fault(kind, int(step), int(on_rank) if on_rank else None))
        return cls(faults, rank)

    def _due(self, step: int, kinds: tuple[str, ...]) -> list[Fault]:
        return [f for f in self.faults if f.step == step and f.kind in kinds]

    def before_step(self, step: int) -> None:
        for fault in self._due(step, ("kill", "hang", "raise")):
            log.warning("fault injection: %s before step %d", fault.kind, step)
            if fault.kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if fault.kind == "hang":
                while True:
                    time.sleep(3600)
            raise InjectedFault(f"injected failure before step {step}")

    def at_checkpoint(self, phase: str, step: int) -> None:
        """Called by the checkpointer at its ``save`` / ``publish`` points."""
        for fault in self._due(step, (f"kill_{phase}",)):
            log.warning("fault injection: %s at step %d", fault.kind, step)
            os.kill(os.getpid(), signal.SIGKILL)

    def after_backward(self, step: int, ddp_chunks: list[Any]) -> None:
        if not self._due(step, ("nan",)):
            return
        log.warning("fault injection: NaN gradients at step %d", step)
        for chunk in ddp_chunks:
            for param in chunk.parameters():
                if getattr(param, "main_grad", None) is not None:
                    param.main_grad.fill_(float("nan"))
