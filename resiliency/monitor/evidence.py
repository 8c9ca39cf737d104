"""What each attempt records about itself: who ran where, startup timings, what the failure lost.

Rank 0 adds to ``attempts/attempt-NN.json``: ``ranks`` (rank, host, pid), ``hosts``,
``startup`` (process start, configure, restore start, first step start/end: the trainer's half
of the RTO) and ``recovered_from`` (the previous attempt's last step, the step restored, lost
steps and tokens). Every rank that fails with an exception writes
``attempts/ranks/attempt-NN.rank-R.failure.json`` with a timestamp, so the first failing rank can be
told apart from the peers that merely timed out waiting for it
(:mod:`resiliency.monitor.postmortem`).
"""

from __future__ import annotations

import logging
import os
import socket
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil
import torch.distributed as dist

from pretrain.context import startup_clock
from pretrain.context.failures import Failure, classify
from pretrain.context.startup_clock import host_clock, host_identity
from pretrain.train.hooks import StepResult, TrainHook
from resiliency.monitor.postmortem import failure_path, last_step_between, lost_steps, read_record
from resiliency.monitor.stacks import waits_on_peers
from resiliency.storage.attempts import recorded_attempts
from resiliency.storage.layout import atomic_write_json

if TYPE_CHECKING:
    from pretrain.platform.distributed import DistEnv
    from pretrain.train.view import TrainerView
    from resiliency.run_context import RunContext

log = logging.getLogger(__name__)


# What a process group's transport says when a peer went away under a collective, wherever
# the Python frame that waited on it was (our own timed waits wrap it in a TimeoutError). Not
# any NCCL error: a rank's own GPU or NIC fault is its failure, not a peer's.
_TRANSPORT_MARKERS = (
    "gloo/transport/",
    "Connection closed by peer",
    "Connection reset by peer",
    "NCCL communicator was aborted",
    "remote process exited or there was a network error",
)


def raised_in_collective(exc: BaseException) -> bool:
    """Whether ``exc``, or an exception it was raised from, came out of a collective."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        frames = traceback.extract_tb(current.__traceback__)[::-1]  # innermost first
        if waits_on_peers([(f.filename, f.lineno or 0) for f in frames]):
            return True
        if isinstance(current, dist.DistNetworkError) or any(
            m in str(current) for m in _TRANSPORT_MARKERS
        ):
            return True
        current = current.__cause__ or current.__context__
    return False


def failure_cause(failure: Failure, in_collective: bool) -> str:
    if failure.kind != "infrastructure":
        return failure.kind
    text = failure.message.lower()
    if "timeout" in text or "timed out" in text:
        return "collective timeout" if in_collective else "timeout"
    return "lost peer" if in_collective else "infrastructure"


def write_failure_file(path: Path, rank: int, exc: BaseException, step: int | None) -> dict:
    failure = classify(exc)
    in_collective = raised_in_collective(exc)
    body = {
        "rank": rank,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "time": time.time(),
        "clock": host_clock(),
        "boot_id": host_identity()["boot_id"],
        "step": step,
        "failure_class": failure.kind,
        "exit_code": failure.exit_code,
        "retryable": failure.retryable,
        "cause": failure_cause(failure, in_collective),
        "in_collective": in_collective,
        "message": failure.message[:2000],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, body)
    return body


def _spawned_wall() -> float:
    """When the launcher spawned this worker, wall clock: a standby's fork is not the start
    (the standby worker waited for it, which the start-up must count)."""
    spawned = startup_clock.spawned_at()
    if spawned is None:
        return psutil.Process().create_time()
    return spawned - startup_clock.wall_to_clock_offset()


class AttemptEvidenceHook(TrainHook):
    """Startup clock and rank inventory of this attempt; per-rank failure files."""

    def __init__(
        self,
        env: "DistEnv",
        run_dir: Path,
        ctx: "RunContext",
        lost_peer_grace_s: float = 0.0,
    ) -> None:
        self.env, self.run_dir, self.ctx = env, run_dir, ctx
        self.lost_peer_grace_s = lost_peer_grace_s
        self.times: dict[str, float] = {"process_start": _spawned_wall()}
        self.ranks: list[dict[str, Any]] = []

    def configure(self, run: Any, dp: int) -> Any:
        self.times["configure_at"] = time.time()
        return run

    def on_start(self, trainer: "TrainerView") -> None:
        self.times["load_started_at"] = time.time()
        gathered: list[Any] = [None] * self.env.world_size
        dist.all_gather_object(
            gathered, {"rank": self.env.rank, "host": socket.gethostname(), "pid": os.getpid()}
        )
        self.ranks = gathered

    def before_step(self, trainer: "TrainerView") -> None:
        self.times.setdefault("first_step_started_at", time.time())

    def after_step(self, trainer: "TrainerView", result: StepResult) -> None:
        if "first_step_done_at" in self.times:
            return
        self.times["first_step_done_at"] = time.time()
        if self.env.rank == 0:
            self._record(recovered_from=self._recovered_from(trainer))

    def on_exception(self, trainer: "TrainerView | None", exc: BaseException) -> None:
        attempt = self.ctx.attempt
        if attempt < 0:
            return  # failed before an attempt id existed: nothing to attach the file to
        step = trainer.state.step if trainer is not None else None
        path = failure_path(self.ctx.layout, attempt, self.env.rank)
        try:
            body = write_failure_file(path, self.env.rank, exc, step)
        except OSError as err:
            log.warning("could not write %s: %s", path, err)
            body = {}
        if body.get("cause") == "lost peer" and self.lost_peer_grace_s > 0:
            # The launcher reports the first exit it sees as the failure: a victim that exits
            # at once can beat the dead peer to it (measured: 2 in 9 runs) and hide the cause.
            log.info(
                "lost a peer: exiting in %.1f s so the launcher sees the rank that failed first",
                self.lost_peer_grace_s,
            )
            time.sleep(self.lost_peer_grace_s)
        if self.env.rank == 0 and "first_step_done_at" not in self.times:
            self._record()

    def _record(self, **extra: Any) -> None:
        hosts = sorted({r["host"] for r in self.ranks})
        self.ctx.update(
            ranks=self.ranks,
            hosts=hosts,
            startup=dict(self.times),
            # rank 0's start-up phases on its host's clock: the recovery ledger's second half
            startup_clock={**host_identity(), "marks": startup_clock.marks()},
            **extra,
        )

    def _recovered_from(self, trainer: "TrainerView") -> dict[str, Any] | None:
        layout, attempt = self.ctx.layout, self.ctx.attempt
        earlier = [a for a in recorded_attempts(layout) if a < attempt]
        if not earlier:
            return None
        previous = read_record(layout, earlier[-1])
        start = self.ctx.info.get("start_time", time.time())
        last = last_step_between(self.run_dir, previous.get("start_time", 0.0), start)
        restored = self.ctx.restored_step
        lost = lost_steps(last, restored)
        return {
            "attempt": earlier[-1],
            "status": previous.get("status"),
            "last_step": last,
            "restored_step": restored,
            "lost_steps": lost,
            "lost_tokens": lost * trainer.tokens_per_step,
        }
