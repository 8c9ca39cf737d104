"""``ls <output_dir>``: the runs under an output root, one row each (newest step, status of the
newest attempt, how long ago its newest step was committed)."""

from __future__ import annotations

import time
from pathlib import Path

from resiliency.cli.attempt_table import KILLED_STATUSES
from resiliency.storage.attempts import read_attempt_record, recorded_attempts
from resiliency.storage.layout import COMMITTED_NAME, RunLayout
from resiliency.storage.lease import owner_liveness, read_lease

_ROW = "{:<28}  {:>11}  {:<10}  {:>8}  {:>8}"


def run_dirs(root: Path) -> list[RunLayout]:
    """The run dirs directly under ``root`` (each has steps/ or attempts/), by name."""
    if not root.is_dir():
        return []
    found = (RunLayout.from_run_dir(p) for p in sorted(root.iterdir()) if p.is_dir())
    return [r for r in found if r.steps_dir.is_dir() or r.attempts_dir.is_dir()]


def run_rows(runs: list[RunLayout], now: float | None = None) -> list[str]:
    now = time.time() if now is None else now
    rows = [_ROW.format("RUN", "NEWEST STEP", "STATUS", "ATTEMPTS", "AGE").rstrip()]
    for layout in runs:
        steps = layout.published_steps()
        age = _age(layout, steps[-1], now) if steps else "-"
        attempts = recorded_attempts(layout)
        row = _ROW.format(layout.run_id, steps[-1] if steps else "-", _status(layout, attempts),
                          len(attempts), age)  # fmt: skip
        rows.append(row.rstrip())
    return rows


def _status(layout: RunLayout, attempts: list[int]) -> str:
    """The newest attempt's status; one still 'running' whose owner is provably gone: died."""
    if not attempts:
        return "-"
    record = read_attempt_record(layout, attempts[-1]) or {}
    status = str(record.get("status", "unreadable"))
    if status in KILLED_STATUSES and not _owner_may_live(layout):
        return "died"
    return status


def _owner_may_live(layout: RunLayout) -> bool:
    try:
        lease = read_lease(layout)
    except ValueError:
        return False
    if lease is None:
        return False
    alive, _ = owner_liveness(lease.host, lease.pid, lease.pid_ns, lease.pid_start)
    return alive is not False  # another host's owner: not provably gone


def _age(layout: RunLayout, step: int, now: float) -> str:
    try:
        seconds = now - (layout.step_dir(step) / COMMITTED_NAME).stat().st_mtime
    except OSError:
        return "-"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"
