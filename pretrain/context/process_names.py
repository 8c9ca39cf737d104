"""The names ``ps``/``top`` show for a run's processes (``/proc/<pid>/comm``, 15 bytes at
most): how an operator, the soak or a benchmark tells them apart from outside."""

from __future__ import annotations

RANK_PREFIX = "mcore-rank"  # a standby's forked worker: its argv is the standby's
WORKER = "mcore-worker"  # a forked worker without a RANK
WRITER = "mcore-ckpt-wr"  # a rank's checkpoint writer process (async saves)


def rank_name(rank: str | int | None) -> str:
    return f"{RANK_PREFIX}{rank}" if rank is not None else WORKER


def name_this_process(name: str) -> None:
    """Set this process's name; best effort (not Linux: unchanged)."""
    try:
        with open("/proc/self/comm", "w") as comm:
            comm.write(name[:15])
    except OSError:
        pass
