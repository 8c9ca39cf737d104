"""The run context: who owns this run directory now, which attempt this is, and its record.

Every resiliency hook receives the one :class:`RunContext` of a run (``resiliency.hooks``);
the ownership hooks (:mod:`resiliency.monitor.ownership`) acquire and release it, so attempt
records exist with checkpointing off too.
"""

from __future__ import annotations

import time
from typing import Any

from pretrain.platform.distributed import broadcast_object
from resiliency.storage.attempts import (
    TERMINAL_STATUSES,
    claim_attempt,
    ensure_run_record,
    write_attempt_record,
)
from resiliency.storage.layout import RunLayout
from resiliency.storage.lease import LeaseHeldError, LeaseLostError, RunLease, process_identity


class RunContext:
    """The run as every resiliency hook sees it: its layout, this attempt and its record, the
    run's single-writer lease, and the step this attempt restored (if any).

    Rank 0 holds the lease and claims an attempt id for all ranks (``acquire``, collective).
    The lease's generation fences every write a restore would see (``fence``); when the
    heartbeat finds the lease taken over, ``lost`` says by whom and the run stops at the next
    step boundary with exit 6. Built for every run, checkpointing or not, so every attempt has
    its record."""

    def __init__(self, layout: RunLayout, lease_timeout_s: float) -> None:
        self.layout, self.timeout_s = layout, lease_timeout_s
        self.lease: RunLease | None = None
        self.attempt = -1
        self.info: dict[str, Any] = {}
        self.restored_step: int | None = None  # set by the checkpoint hook once restored
        self.fenced: str | None = None  # the lease was taken over: by whom (every rank)
        # A terminal record that could not be written (a full disk): written again at close.
        self.pending_record: tuple[str, dict[str, Any]] | None = None

    @classmethod
    def unowned(cls, layout: RunLayout, attempt: int) -> RunContext:
        """A context for a tool that takes no lease of its own here (checkpoint import holds
        one around its save; benchmarks write to a scratch run): a fixed attempt, no fence."""
        ctx = cls(layout, lease_timeout_s=0.0)
        ctx.attempt = attempt
        return ctx

    @property
    def fence(self) -> RunLease | None:
        """Rank 0's lease, which every publish, latest.json move and delete holds."""
        return self.lease

    @property
    def lost(self) -> LeaseLostError | None:
        return self.lease.lost if self.lease is not None else None

    def acquire(self, rank: int, world_size: int) -> int:
        error, attempt = None, -1
        if rank == 0:
            try:
                self.info = {
                    "status": "starting",
                    "world_size": world_size,
                    "start_time": time.time(),
                    **process_identity(),
                }
                attempt = self.attempt = claim_attempt(self.layout, self.info)
                self.lease = RunLease(self.layout, attempt, self.timeout_s)
                self.lease.acquire()
                self.lease.start_heartbeat()
                self.record("starting", lease_generation=self.lease.generation)
                ensure_run_record(self.layout, attempt)
            except LeaseHeldError as exc:
                error = str(exc)
        error, self.attempt = broadcast_object((error, attempt))
        if error:
            raise LeaseHeldError(error)
        return self.attempt

    def lost_everywhere(self) -> str | None:
        """Collective: rank 0's word on whether the lease was taken over (why, or None)."""
        lost = self.lost
        return broadcast_object(str(lost) if lost is not None else None)

    @property
    def ended(self) -> bool:
        """A terminal status is recorded (finished, preempted, interrupted, failed, fenced)."""
        return self.info.get("status") in TERMINAL_STATUSES

    def update(self, **extra: Any) -> None:
        """Add fields to this attempt's record, its status unchanged (rank 0)."""
        self.record(self.info.get("status", "running"), **extra)

    def record(self, status: str, **extra: Any) -> None:
        """Update this attempt's record (rank 0); earlier fields are kept."""
        if self.lease is None:
            return
        self.info.update(status=status, **extra)
        if status in TERMINAL_STATUSES:
            self.info["end_time"] = time.time()
        write_attempt_record(self.layout, self.attempt, self.info)

    def release(self) -> None:
        if self.lease is not None:
            self.lease.release()
            self.lease = None
