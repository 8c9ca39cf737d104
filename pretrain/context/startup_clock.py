"""This host's clock, and when each phase of this process's way to its first step ended.

Every stamp a recovery ledger compares across processes (the launcher's log, a standby
server's reaping, a new worker's phases) is read from one source per host: ``CLOCK_BOOTTIME``,
which is system-wide, never steps with NTP, and is the clock the kernel counts a process's
start time in (``/proc/<pid>/stat``), so a process's own spawn moment needs no stamp of its own.
Stamps are only comparable between processes of the same boot of the same host
(:func:`host_identity`).

The marks are this process's own: each phase's end is recorded once, the first time it is
reached (a later rebuild or rollback does not move it). Phases, in order (the ledger's owner,
``resiliency.monitor.recovery``, adds the launcher's part in front of them): imports,
process group, setup, model build, restore read, restore load, first step.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

# Set by the standby worker (launch.standby.worker) for a worker it hands to the standby:
# the launcher spawned the standby worker, not the forked process that trains.
SPAWNED_ENV = "MCORE_RECIPES_SPAWNED_CLOCK"
PHASES = (
    "imports",  # spawn -> torch, megatron-core and the trainer imported (the CPU shim applied)
    "process_group",  # -> the default process group joined
    "setup",  # -> hooks built and configured: lease, attempt record, restore planned
    "model_build",  # -> model, optimizer and data built
    "restore_read",  # -> the checkpoint's shards read into memory (none: no time)
    "restore_load",  # -> the shards and loop state loaded into model and optimizer
    "first_step",  # -> the first training step done
)
_marks: dict[str, float] = {}


def host_clock() -> float:
    """Seconds since this host booted (``CLOCK_BOOTTIME``; monotonic elsewhere)."""
    clock = getattr(time, "CLOCK_BOOTTIME", None)
    return time.clock_gettime(clock) if clock is not None else time.monotonic()


def wall_to_clock_offset() -> float:
    """host clock - wall clock, now (the same on this host until NTP steps the wall clock)."""
    return host_clock() - time.time()


def host_identity() -> dict[str, str]:
    """Which clock a stamp was read from: the host and its boot."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = "unknown"
    return {"host": socket.gethostname(), "boot_id": boot}


def process_start(pid: int | None = None) -> float | None:
    """When the kernel started ``pid`` (this process by default), on the host clock; None
    where ``/proc`` does not say (10 ms resolution: the kernel counts clock ticks)."""
    try:
        stat = Path(f"/proc/{pid or os.getpid()}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: count from its end.
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[19]) / os.sysconf("SC_CLK_TCK")


def spawned_at() -> float | None:
    """When the launcher spawned this worker: its standby worker's start where one handed
    it over, else this process's own start (an exec keeps the pid and the start time)."""
    handed = os.environ.get(SPAWNED_ENV)
    if handed:
        try:
            return float(handed)
        except ValueError:
            pass
    return process_start()


def mark(phase: str) -> None:
    """``phase`` ended now (the first time only; nothing after the first step: a rollback's
    restore is not start-up)."""
    if phase not in PHASES:
        raise ValueError(f"unknown start-up phase {phase!r}; one of {', '.join(PHASES)}")
    if "first_step" not in _marks:
        _marks.setdefault(phase, host_clock())


def marks() -> dict[str, float]:
    """The phases this process has ended, with ``spawned`` first, on the host clock."""
    spawned = spawned_at()
    return {**({"spawned": spawned} if spawned is not None else {}), **_marks}
