"""What the drill's runs left behind, read back: metrics per attempt, logs, restores, timings.

Nothing here judges; :mod:`drill.acceptance` does. Metrics records are assigned to the
attempt that wrote them by time (each attempt's record holds its start time), so a step redone
after a restart is seen both as the killed attempt logged it and as the new attempt did.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from drill.runs import Scenario
from pretrain.context.run_dir import RunDir, iter_jsonl
from resiliency.storage.attempts import recorded_attempts
from resiliency.storage.layout import RunLayout

_SAVE_RE = re.compile(r"checkpoint step (\d+) published: \S+ \(([\d.]+) s\)")
_SKIP_RE = re.compile(r"restore: skipping (\S+): (.+)$")
_RESUMED_RE = re.compile(r"restore: resumed from (\S+) at step (\d+)")
_FRESH_OPTIMIZER = "FRESH optimizer state"


@dataclass(frozen=True)
class StepRecord:
    step: int
    loss: float
    grad_norm: float
    lr: float
    step_time_s: float
    time: float


@dataclass(frozen=True)
class AttemptView:
    attempt: int
    record: dict[str, Any]
    steps: tuple[StepRecord, ...]  # what this attempt logged, in order

    @property
    def restored_step(self) -> int | None:
        return self.record.get("restored_step")

    @property
    def start_time(self) -> float:
        return float(self.record.get("start_time", 0.0))

    @property
    def last_step(self) -> StepRecord | None:
        return self.steps[-1] if self.steps else None


@dataclass(frozen=True)
class LogFacts:
    saves: tuple[tuple[int, float], ...] = ()  # (step, seconds) per published checkpoint
    skipped: tuple[tuple[str, str], ...] = ()  # (dir name, reason) rejected at restore
    resumed: tuple[tuple[str, int], ...] = ()  # (dir name, step) restored
    fresh_optimizer: bool = False


@dataclass(frozen=True)
class RestoreEvent:
    """One launch that had to restore a checkpoint."""

    scenario: str
    launch: int
    expected_step: int
    attempt: AttemptView | None  # None: the launch never recorded an attempt
    log: LogFacts
    previous: AttemptView | None  # the attempt that ran before (failed, or the copied run's)
    previous_end: float | None  # when the previous launch had exited (drill clock)


@dataclass(frozen=True)
class FailureTiming:
    scenario: str
    fault: str
    last_step: int  # last step the failed attempt completed
    restored_step: int
    lost_steps: int
    detect_s: float  # failure -> the old launch has exited
    restart_s: float  # old launch exited -> new attempt started (launch, init, lease)
    load_s: float  # new attempt started -> first step begins (model build + checkpoint load)
    rto_s: float  # failure -> first new step done
    catch_up_s: float | None  # failure -> lost progress redone


@dataclass
class RunEvidence:
    run_dir: Path
    attempts: dict[int, AttemptView] = field(default_factory=dict)
    steps: dict[int, StepRecord] = field(default_factory=dict)  # last record per step wins
    records: list[StepRecord] = field(default_factory=list)  # file order


def read_records(run_dir: Path) -> list[StepRecord]:
    records = []
    for r in iter_jsonl(RunDir(run_dir).steps_metrics):
        records.append(
            StepRecord(r["step"], r["loss"], r["grad_norm"], r["lr"], r["step_time_s"], r["time"])
        )
    return records


def read_attempt_records(run_dir: Path) -> dict[int, dict[str, Any]]:
    layout = RunLayout.from_run_dir(run_dir)
    return {a: json.loads(layout.attempt_path(a).read_text()) for a in recorded_attempts(layout)}


def _owner(record: StepRecord, starts: list[tuple[float, int]]) -> int | None:
    owner = None
    for start, attempt in starts:
        if start <= record.time:
            owner = attempt
    return owner


def read_run(run_dir: Path) -> RunEvidence:
    records = read_records(run_dir)
    bodies = read_attempt_records(run_dir)
    starts = sorted((float(b.get("start_time", 0.0)), a) for a, b in bodies.items())
    grouped: dict[int, list[StepRecord]] = {a: [] for a in bodies}
    for record in records:
        owner = _owner(record, starts)
        if owner is not None:
            grouped[owner].append(record)
    attempts = {a: AttemptView(a, bodies[a], tuple(grouped[a])) for a in sorted(bodies)}
    return RunEvidence(run_dir, attempts, {r.step: r for r in records}, records)


def read_log(path: Path) -> LogFacts:
    if not path.is_file():
        return LogFacts()
    saves, skipped, resumed, fresh = [], [], [], False
    for line in path.read_text(errors="replace").splitlines():
        if m := _SAVE_RE.search(line):
            saves.append((int(m.group(1)), float(m.group(2))))
        elif m := _SKIP_RE.search(line):
            skipped.append((m.group(1), m.group(2).strip()))
        elif m := _RESUMED_RE.search(line):
            resumed.append((m.group(1), int(m.group(2))))
        fresh = fresh or _FRESH_OPTIMIZER in line
    return LogFacts(
        tuple(saves), tuple(dict.fromkeys(skipped)), tuple(dict.fromkeys(resumed)), fresh
    )


def restore_events(scenario: Scenario, run: RunEvidence) -> list[RestoreEvent]:
    events = []
    for i, expected in enumerate(scenario.expected_restores[: len(scenario.launches)]):
        if expected is None:
            continue
        attempt_id = scenario.attempts[i]
        attempt = run.attempts.get(attempt_id) if attempt_id is not None else None
        previous = _previous_attempt(run, attempt_id)
        previous_end = scenario.launches[i - 1].end if i > 0 else None
        events.append(
            RestoreEvent(
                scenario.name,
                i,
                expected,
                attempt,
                read_log(scenario.launches[i].spec.log_path),
                previous,
                previous_end,
            )
        )
    return events


def _previous_attempt(run: RunEvidence, attempt_id: int | None) -> AttemptView | None:
    earlier = [a for a in run.attempts if attempt_id is None or a < attempt_id]
    return run.attempts[max(earlier)] if earlier else None


def failure_timing(event: RestoreEvent, fault: str) -> FailureTiming | None:
    """Timings of a kill and its recovery; None when a side of it left no record."""
    failed, new = event.previous, event.attempt
    if failed is None or new is None or not new.steps or event.previous_end is None:
        return None
    last = failed.last_step
    failure_time = last.time if last else failed.start_time
    last_step = last.step if last else 0
    first = new.steps[0]
    redone = [r for r in new.steps if r.step >= last_step]
    restored = new.restored_step or 0
    return FailureTiming(
        event.scenario,
        fault,
        last_step,
        restored,
        max(last_step - restored, 0),
        detect_s=event.previous_end - failure_time,
        restart_s=new.start_time - event.previous_end,
        load_s=load_seconds(new) or 0.0,
        rto_s=first.time - failure_time,
        catch_up_s=(redone[0].time - failure_time) if redone else None,
    )


def load_seconds(attempt: AttemptView) -> float | None:
    """Attempt start to its first step's start: model build plus checkpoint load."""
    if not attempt.steps:
        return None
    first = attempt.steps[0]
    return first.time - first.step_time_s - attempt.start_time


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default), None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)
