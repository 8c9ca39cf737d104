"""The goodput ledger: where a run's wall time went, across every attempt.

Built only from what runs write anyway (attempt records, ``metrics/steps.jsonl``,
``checkpoints.jsonl``, ``eval.jsonl``), so it also works on a run that is over or dead. The
categories follow Google's ml-goodput-measurement (productive training, checkpoint save and
load, program startup, wasted progress, infrastructure downtime); that library itself reads
its events from Cloud Logging, which a Slurm or on-prem run does not have, so the arithmetic is
done here. Every second between the first attempt's process start and the last attempt's end
falls in exactly one category: they add up to the wall time.

- productive: step time of steps that count (never recomputed);
- lost: step time of steps a later attempt recomputed (after its restored step);
- checkpoint_save: time the loop was blocked by saves;
- evaluation: validation and test passes;
- startup: process start to the first step, less the restore;
- restore: checkpoint load and planning (load start to the first step) of restored attempts;
- downtime: between one attempt's end and the next one's process start (scheduler, launcher);
- paused: the same gap after an attempt the user ended (Ctrl-C: ``interrupted``) or that
  finished its steps (a run extended later): the user's time, not the system's, so goodput
  is productive time over the wall time less the pauses;
- other: the rest of an attempt (logging, hooks, shutdown, a killed attempt's last moments).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pretrain.context.run_dir import RunDir, read_jsonl
from resiliency.storage.attempts import recorded_attempts
from resiliency.storage.layout import RunLayout

CATEGORIES = (
    "productive",
    "lost",
    "checkpoint_save",
    "evaluation",
    "startup",
    "restore",
    "downtime",
    "paused",
    "other",
)
# Attempts whose end the user chose: the wait for the next launch is a pause, not downtime.
USER_ENDED = ("interrupted", "finished")


@dataclass
class Ledger:
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0.0))
    wall_s: float = 0.0
    attempts: int = 0
    lost_steps: int = 0

    @property
    def goodput(self) -> float | None:
        """Productive time over the time the run was meant to run (wall less pauses)."""
        meant = self.wall_s - self.seconds["paused"]
        return self.seconds["productive"] / meant if meant > 0 else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "goodput": self.goodput,
            "wall_s": self.wall_s,
            "attempts": self.attempts,
            "lost_steps": self.lost_steps,
            "seconds": self.seconds,
        }


def _records(run_dir: Path) -> list[dict[str, Any]]:
    layout = RunLayout.from_run_dir(run_dir)
    records = []
    for attempt in recorded_attempts(layout):
        try:
            record = json.loads(layout.attempt_path(attempt).read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if record.get("start_time") is not None:
            records.append(record)
    return sorted(records, key=_begin)


def _begin(record: dict[str, Any]) -> float:
    started = (record.get("startup") or {}).get("process_start")
    return float(record["start_time"] if started is None else started)


def build_ledger(run_dir: Path) -> Ledger:
    records = _records(run_dir)
    ledger = Ledger(attempts=len(records))
    if not records:
        return ledger
    paths = RunDir(run_dir)
    steps, saves = read_jsonl(paths.steps_metrics), read_jsonl(paths.checkpoint_metrics)
    evals = read_jsonl(paths.eval_metrics)
    begins = [_begin(r) for r in records]
    ends = [
        _end(r, begins[i + 1] if i + 1 < len(records) else None, steps)
        for i, r in enumerate(records)
    ]
    windows = list(zip(begins, ends))
    # An attempt that restored nothing and trained nothing (refused at config, killed in
    # start-up) says nothing about what was lost: the next one that did decides.
    continued = [
        r.get("restored_step") is not None or bool(_in(steps, w)) for r, w in zip(records, windows)
    ]
    for i, record in enumerate(records):
        following = next((records[j] for j in range(i + 1, len(records)) if continued[j]), None)
        _attempt(ledger, record, windows[i], following, steps, saves, evals)
        if i + 1 < len(records):
            gap = "paused" if record.get("status") in USER_ENDED else "downtime"
            ledger.seconds[gap] += max(0.0, begins[i + 1] - ends[i])
    ledger.wall_s = ends[-1] - begins[0]
    return ledger


def _end(record: dict[str, Any], next_begin: float | None, steps: list[dict[str, Any]]) -> float:
    """An attempt ends at its record's end time; a killed one at its last step's end, never
    after the next attempt began."""
    begin = _begin(record)
    end = record.get("end_time")
    if end is None:
        times = [s["time"] for s in steps if s.get("time", 0) >= begin]
        times = [t for t in times if next_begin is None or t <= next_begin]
        end = max(times, default=begin)
    return min(float(end), next_begin) if next_begin is not None else float(end)


def _in(events: list[dict[str, Any]], window: tuple[float, float]) -> list[dict[str, Any]]:
    return [e for e in events if window[0] <= e.get("time", -1) <= window[1]]


def _attempt(
    ledger: Ledger,
    record: dict[str, Any],
    window: tuple[float, float],
    following: dict[str, Any] | None,
    steps: list[dict[str, Any]],
    saves: list[dict[str, Any]],
    evals: list[dict[str, Any]],
) -> None:
    begin, end = window
    parts = dict.fromkeys(CATEGORIES, 0.0)
    # Steps after the next attempt's restored step were done again: lost.
    redo_after = None if following is None else (following.get("restored_step") or 0)
    for step in _in(steps, window):
        lost = redo_after is not None and step["step"] > redo_after
        parts["lost" if lost else "productive"] += step.get("step_time_s", 0.0)
        ledger.lost_steps += int(lost)
    parts["checkpoint_save"] = sum(s.get("blocked_s", 0.0) for s in _in(saves, window))
    parts["evaluation"] = sum(e.get("seconds", 0.0) for e in _in(evals, window))
    startup = record.get("startup") or {}
    first = startup.get("first_step_started_at")
    first = min(float(first), end) if first is not None else end
    if record.get("restored_step") is not None and startup.get("load_started_at") is not None:
        parts["restore"] = max(0.0, first - float(startup["load_started_at"]))
    parts["startup"] = max(0.0, first - begin - parts["restore"])
    # The remainder, so the categories add up to the attempt's duration exactly.
    parts["other"] = (end - begin) - sum(parts.values())
    for name, value in parts.items():
        ledger.seconds[name] += value


def format_ledger(ledger: Ledger) -> str:
    if ledger.goodput is None:
        return "goodput: no attempt with a start time recorded yet"
    lines = [
        f"goodput {ledger.goodput:.1%} of {ledger.wall_s:.1f} s wall"
        + (f" less {ledger.seconds['paused']:.1f} s paused" if ledger.seconds["paused"] else "")
        + f" over {ledger.attempts} attempt(s); {ledger.lost_steps} step(s) recomputed"
    ]
    for name in CATEGORIES:
        value = ledger.seconds[name]
        lines.append(f"  {name:<16} {value:10.2f} s  {value / ledger.wall_s:6.1%}")
    return "\n".join(lines)
