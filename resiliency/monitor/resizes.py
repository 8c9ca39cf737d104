"""Elastic resizes as a run's records show them (parallel.elastic): which attempt restored at
another size than the step it restored was saved at, why, how long the recovery took and
what it lost (the previous attempt's recovery ledger), and the throughput at each size
(``steps.jsonl`` carries each step's DP and world size)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from pretrain.context.run_dir import RunDir, read_jsonl
from resiliency.storage.attempts import read_attempt_record, recorded_attempts
from resiliency.storage.layout import RunLayout


def resizes(run_dir: Path) -> list[dict[str, Any]]:
    """Every resize, in attempt order, with the recovery that led to it (the previous
    attempt's ledger: its fault, the seconds to the new first step, the steps lost)."""
    layout = RunLayout.from_run_dir(run_dir)
    found, previous = [], None
    for attempt in recorded_attempts(layout):
        record = read_attempt_record(layout, attempt) or {}
        if record.get("resized") and previous is not None:
            found.append({"attempt": attempt, **record["resized"], **_recovery(previous, record)})
        previous = record
    return found


def _recovery(previous: dict[str, Any], record: dict[str, Any]) -> dict[str, Any]:
    """Why the previous attempt ended (a failure's cause, or the launcher stopping a healthy
    group for a node that joined), how long until this one's first step, what was lost."""
    rto = previous.get("rto") or {}
    if previous.get("status") == "preempted":
        cause = "the launcher stopped the group (a node joined); emergency save"
    else:
        cause = previous.get("failure_cause") or previous.get("status") or "?"
    resumed_s = rto.get("total_s")
    first_step = (record.get("startup") or {}).get("first_step_started_at")
    if resumed_s is None and first_step is not None and previous.get("end_time") is not None:
        resumed_s = first_step - previous["end_time"]
    lost = (rto.get("work_lost") or {}).get("steps", previous.get("lost_steps"))
    return {"cause": cause, "time_to_resume_s": resumed_s, "steps_lost": lost}


def throughput_by_size(run_dir: Path) -> list[dict[str, Any]]:
    """Per (DP, world size) the run trained at: its steps and their median tokens/s."""
    groups: dict[tuple[int, int], list[float]] = {}
    for step in read_jsonl(RunDir(run_dir).steps_metrics):
        if "dp" in step and "world_size" in step:
            groups.setdefault((step["dp"], step["world_size"]), []).append(step["tokens_per_s"])
    return [
        {"dp": dp, "world_size": world, "steps": len(rates),
         "tokens_per_s": statistics.median(rates)}
        for (dp, world), rates in sorted(groups.items(), reverse=True)
    ]  # fmt: skip


def format_resizes(found: list[dict[str, Any]], sizes: list[dict[str, Any]]) -> str:
    lines = []
    for r in found:
        resume = r["time_to_resume_s"]
        lines.append(
            f"resize at attempt {r['attempt']}: {r['kind']} DP {r['from']['dp']} -> "
            f"{r['to']['dp']} ({r['from']['world_size']} -> {r['to']['world_size']} ranks) "
            f"from step {r['step']}; cause: {r['cause']}; resumed in "
            + (f"{resume:.1f} s" if resume is not None else "n/a")
            + f"; steps lost: {r['steps_lost'] if r['steps_lost'] is not None else 'n/a'}"
        )
    if len(sizes) > 1 or found:
        lines.append(
            "throughput by size: "
            + "; ".join(
                f"DP {s['dp']} ({s['world_size']} ranks): {s['steps']} steps, "
                f"{s['tokens_per_s']:.0f} tokens/s median"
                for s in sizes
            )
        )
    return "\n".join(lines)
