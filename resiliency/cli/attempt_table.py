"""The attempts section of ``ls``: one row per ``attempts/attempt-NN.json``.

The checkpoint hook (resiliency/checkpoint/hook.py) writes ``status`` starting -> running ->
finished | preempted | failed, with ``exit_code``, ``failure_class`` and ``error`` on failure,
``restored_step``/``restored_tier`` once restored, and the last ``step``. A record that still
says starting/running while no live lease holds the run was killed (node loss, OOM killer, time
limit): launch/retry_policy.py treats it as an infrastructure failure, and so does this table.
"""

from __future__ import annotations

import json
import time
from typing import Any

from resiliency.storage.attempts import recorded_attempts
from resiliency.storage.layout import RunLayout

KILLED_STATUSES = ("starting", "running")
ERROR_CHARS = 100  # first line of the error, cut: the record holds the rest

_ROW = "{:<10}  {:<10}  {:>4}  {:<14}  {:>11}  {:>9}  {:>5}  {:<16}  {:>5}  {}"
HEADER = ("ATTEMPT", "STATUS", "EXIT", "FAILURE", "RESTORED", "LAST STEP", "WORLD")
HEADER += ("STARTED", "TOOK", "NOTE")


def _row(*cols: object) -> str:
    return _ROW.format(*cols).rstrip()


def attempt_rows(layout: RunLayout, live_attempt: int | None, now: float) -> list[str]:
    """Header and one row per attempt record, oldest first (as they happened)."""
    rows = [_row(*HEADER)]
    for attempt in recorded_attempts(layout):
        path = layout.attempt_path(attempt)
        try:
            record = json.loads(path.read_text())
            if not isinstance(record, dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as exc:
            rows.append(_row(path.stem, "unreadable", *["-"] * 7, str(exc)))
            continue
        rows.append(_row(path.stem, *_columns(record, attempt == live_attempt, now)))
    if len(rows) == 1:
        rows.append("(no attempt records: the trainer never started on this run dir)")
    return rows


def _columns(record: dict[str, Any], live: bool, now: float) -> list[object]:
    status = str(record.get("status", "-"))
    died = status in KILLED_STATUSES and not live
    failure = record.get("failure_class") or ("infrastructure?" if died else "-")
    start, end = record.get("start_time"), record.get("end_time")
    return [
        "died" if died else status,
        _dash(record.get("exit_code")),
        failure,
        _restored(record),
        _dash(record.get("step")),
        _dash(record.get("world_size")),
        _clock(start),
        _took(start, end if end is not None else (now if live else None)),
        "; ".join(_notes(record, status, live, died)),
    ]


def _dash(value: object) -> object:
    return "-" if value is None else value


def _restored(record: dict[str, Any]) -> str:
    """Step restored from (and the tier when local or remote); "<run>@<step>" when it was
    warm-started from another run's step; "fresh" when it started anew."""
    if "restored_step" not in record:
        return "-"  # never got as far as restoring
    step = record["restored_step"]
    source = record.get("init_from")
    if step is None and isinstance(source, dict):  # a warm start: another run's step
        return f"{source.get('run_id')}@{source.get('step')}"
    if step is None:
        return "fresh"
    tier = record.get("restored_tier")
    return f"{step} {tier}" if tier in ("local", "remote") else str(step)


def _clock(epoch: object) -> str:
    if not isinstance(epoch, (int, float)):
        return "-"
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(epoch))


def _took(start: object, end: object) -> str:
    if not isinstance(start, (int, float)) or not isinstance(end, (int, float)):
        return "-"
    seconds = max(0.0, end - start)
    for limit, div, unit in ((120, 1, "s"), (7200, 60, "m"), (172800, 3600, "h")):
        if seconds < limit:
            return f"{seconds / div:.0f}{unit}"
    return f"{seconds / 86400:.0f}d"


def _notes(record: dict[str, Any], status: str, live: bool, died: bool) -> list[str]:
    notes = []
    if live:
        notes.append("live: holds the lease")
    if died:
        notes.append(
            f"record still says {status!r} and no live lease holds the run: killed "
            "(node loss, OOM killer, time limit)"
        )
    if record.get("error"):
        first = str(record["error"]).strip().splitlines()[0]
        notes.append(first if len(first) <= ERROR_CHARS else first[: ERROR_CHARS - 3] + "...")
    if (status == "failed" or died) and record.get("host"):
        notes.append(f"on {record['host']}")
    notes += _resume_notes(record)
    return notes


def _resume_notes(record: dict[str, Any]) -> list[str]:
    """What the restore changed: layout, LR rule, config keys, unhealthy nodes."""
    notes = []
    if record.get("topology_changed"):
        notes.append("restored into a new layout")
    scaling = record.get("lr_scaling")
    if isinstance(scaling, dict):
        notes.append(
            f"LR {scaling.get('rule')}-scaled for global batch "
            f"{scaling.get('saved_global_batch')} -> {scaling.get('global_batch')}"
        )
    changes = record.get("config_changes")
    if isinstance(changes, dict):
        applied = len(changes.get("applied") or {})
        kept = len(changes.get("kept_from_checkpoint") or {})
        if applied or kept:
            notes.append(f"config: {applied} change(s) applied, {kept} kept from checkpoint")
    health = record.get("health")
    nodes = health.get("nodes") if isinstance(health, dict) else None
    bad = sorted(str(n.get("node")) for n in nodes or [] if isinstance(n, dict) and not n.get("ok"))
    if bad:
        notes.append(f"unhealthy node(s): {', '.join(bad)}")
    return notes
