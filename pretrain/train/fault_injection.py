"""Test-only fault injection, driven by ``train.fault`` ("<kind>@<step>[:<rank>]", ';'-separated).

Kinds: kill (SIGKILL self before the step), hang (block forever), raise (deterministic
exception), nan (poison gradients after backward, at that step number whatever it trains on),
spike (a bad batch: the N-th global batch of the data, the one step N trains on until a
rollback moves the cursor, has its loss, and so its gradients, multiplied by ``factor``,
default 1000, every time it is trained on: "spike@<batch>[:<rank>][:<factor>]"), kill_save
(SIGKILL once this step's shards are written, before the commit), kill_publish (SIGKILL
after COMMITTED is written, before the rename), kill_writer (SIGKILL this rank's checkpoint
writer process once this step's async save is handed to it), stop / stop_save /
stop_restore / stop_eval (SIGSTOP this rank: before the step, at the save point, at the start
of restoring this step, in the validation after it; the process freezes as a stuck node
does, every thread with it), slow (from this step on, this rank's step burns ``factor`` times
its CPU time: "slow@<step>:<rank>:<factor>", a straggler), sdc (a transient silent data
corruption: NaN gradients at that step once per process, so a replay of the step computes them
clean), corrupt (once step N is committed, flip one byte of the largest model file of that
step, then SIGKILL this rank: a newest checkpoint that rots on disk, which the restore must
refuse), eio_rehash (this rank's re-hash of step N, while restoring it, fails with EIO, as a
flaky disk or a stale NFS handle would). The break_* kinds break this rank's restore of step N
on purpose, in the smallest way each part of the state can be wrong, as the resume-equivalence
gate's controls (drill/equivalence): break_rng_python, break_rng_numpy, break_rng_torch,
break_rng_ep (one draw too many from that stream; ep: megatron's expert-parallel stream,
Megatron-LM PR #6858), break_adam_step (the optimizer's step counter back to 0, Megatron-Bridge
PR #3832), break_data_cursor (this rank's data from sample 0, Megatron-Bridge PR #5637),
break_param (one element of one parameter off by one ulp). A "/<round>" suffix limits an
entry to one launcher round (TORCHELASTIC_RESTART_COUNT), so a fault can hit once and the
restarted group run clean.
Empty in every shipped recipe.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
KINDS = (
    "kill",
    "hang",
    "raise",
    "nan",
    "spike",
    "kill_save",
    "kill_publish",
    "kill_writer",
    "slow",
    "stop",
    "stop_save",
    "stop_restore",
    "stop_eval",
    "sdc",
    "corrupt",
    "eio_rehash",
    *(f"break_{what}" for what in ("rng_python", "rng_numpy", "rng_torch", "rng_ep")),
    "break_adam_step",
    "break_data_cursor",
    "break_param",
)
ROUND_ENV = "TORCHELASTIC_RESTART_COUNT"
SPIKE_FACTOR = 1000.0  # spike@N without a factor


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    rank: int | None
    factor: float = 1.0  # slow and spike only
    round: int | None = None  # launcher round the entry is limited to (None: every round)


class InjectedFault(RuntimeError):
    """The deterministic user-code failure raised by ``raise@N``."""


class FaultInjector:
    def __init__(self, faults: list[Fault], rank: int) -> None:
        current_round = int(os.environ.get(ROUND_ENV, "0") or 0)
        self.faults = [
            f
            for f in faults
            if (f.rank is None or f.rank == rank) and (f.round is None or f.round == current_round)
        ]
        self._cpu_start: float | None = None
        self._step_cpu_s: float | None = None  # last unslowed forward+backward CPU time

    @classmethod
    def parse(cls, spec: str, rank: int) -> "FaultInjector":
        faults = []
        for item in filter(None, (part.strip() for part in spec.split(";"))):
            faults.append(_parse_entry(item))
        return cls(faults, rank)

    def _due(self, step: int, kinds: tuple[str, ...]) -> list[Fault]:
        return [f for f in self.faults if f.step == step and f.kind in kinds]

    def before_step(self, step: int) -> None:
        self._slow_down(step)
        for fault in self._due(step, ("kill", "hang", "raise", "stop")):
            log.warning("fault injection: %s before step %d", fault.kind, step)
            if fault.kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if fault.kind == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
                continue  # continued (SIGCONT) before anyone killed it: carry on
            if fault.kind == "hang":
                while True:
                    time.sleep(3600)
            raise InjectedFault(f"injected failure before step {step}")

    def at_checkpoint(self, phase: str, step: int, pid: int | None = None) -> None:
        """Called at the checkpointer's ``save`` / ``publish`` / ``writer`` / ``restore`` points
        and in a validation (``eval``); kills ``pid`` (the writer process) or this rank, or stops
        this rank."""
        for fault in self._due(step, (f"kill_{phase}", f"stop_{phase}")):
            log.warning("fault injection: %s at step %d", fault.kind, step)
            if fault.kind.startswith("stop"):
                os.kill(os.getpid(), signal.SIGSTOP)
            else:
                os.kill(pid or os.getpid(), signal.SIGKILL)

    def at_rehash(self, step: int) -> None:
        """Restoring step ``step``, this rank's re-hash of its share starts: ``eio_rehash``."""
        if self._due(step, ("eio_rehash",)):
            log.warning("fault injection: EIO in the re-hash of step %d", step)
            raise OSError(errno.EIO, os.strerror(errno.EIO), f"step {step} (injected)")

    def restore_breaks(self, step: int) -> frozenset[str]:
        """What this rank's restore of step ``step`` must get wrong (the break_* kinds, less
        the prefix: "rng_python", ..., "param")."""
        due = self._due(step, tuple(k for k in KINDS if k.startswith("break_")))
        for fault in due:
            log.warning("fault injection: the restore of step %d breaks %s", step, fault.kind[6:])
        return frozenset(fault.kind.removeprefix("break_") for fault in due)

    def after_commit(self, step: int, model_dir: Path) -> None:
        """Step ``step`` is committed, its model state in ``model_dir``: ``corrupt`` flips one
        byte of its largest file, then SIGKILLs this rank, so the next restore meets it."""
        if not self._due(step, ("corrupt",)):
            return
        files = [p for p in model_dir.rglob("*") if p.is_file()]
        target = max(files, key=lambda p: (p.stat().st_size, p.name))
        with target.open("r+b") as f:
            f.seek(target.stat().st_size // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
        log.warning("fault injection: flipped a byte of %s, then SIGKILL", target)
        os.kill(os.getpid(), signal.SIGKILL)

    def _slow_down(self, step: int) -> None:
        """Busy-burn CPU (not sleep) so the rank is slower at computing, not just late."""
        slow = [f for f in self.faults if f.kind == "slow" and step >= f.step]
        if slow and self._step_cpu_s is not None:
            deadline = time.process_time() + (slow[0].factor - 1.0) * self._step_cpu_s
            while time.process_time() < deadline:
                pass
        self._cpu_start = time.process_time()

    def loss_scale(self, batch: int) -> float:
        """What the loss of global batch ``batch`` (1-based) is multiplied by: 1.0 but for
        a spike."""
        scale = 1.0
        for fault in self._due(batch, ("spike",)):
            log.warning("fault injection: loss x %g on batch %d", fault.factor, batch)
            scale *= fault.factor
        return scale

    def after_backward(self, step: int, ddp_chunks: list[Any]) -> None:
        if self._cpu_start is not None:  # the burn ran before _cpu_start: this is unslowed
            self._step_cpu_s = time.process_time() - self._cpu_start
        due = self._due(step, ("nan", "sdc"))
        if not due:
            return
        # sdc is transient: gone once it hit, so a replay of this step in this process is clean
        self.faults = [f for f in self.faults if f not in due or f.kind != "sdc"]
        log.warning("fault injection: NaN gradients at step %d (%s)", step, due[0].kind)
        for chunk in ddp_chunks:
            for param in chunk.parameters():
                if getattr(param, "main_grad", None) is not None:
                    param.main_grad.fill_(float("nan"))


def _parse_entry(item: str) -> Fault:
    entry, _, round_ = item.partition("/")
    kind, _, where = entry.partition("@")
    step, on_rank, factor, *rest = where.split(":") + ["", ""]
    ok = (
        kind in KINDS
        and step.isdigit()
        and (not on_rank or on_rank.isdigit())
        and not any(rest)
        and (not round_ or round_.isdigit())
        and (not factor or (kind in ("slow", "spike") and _is_factor(factor)))
    )
    if not ok or (kind == "slow" and not (on_rank and factor)):
        raise ValueError(
            f"train.fault: bad entry {item!r}; expected "
            f"<kind>@<step>[:<rank>][/<round>] with kind in {KINDS}, or "
            "slow@<step>:<rank>:<factor>, or spike@<batch>[:<rank>][:<factor>]"
        )
    return Fault(
        kind,
        int(step),
        int(on_rank) if on_rank else None,
        float(factor) if factor else (SPIKE_FACTOR if kind == "spike" else 1.0),
        int(round_) if round_ else None,
    )


def _is_factor(text: str) -> bool:
    try:
        return float(text) >= 1.0
    except ValueError:
        return False
