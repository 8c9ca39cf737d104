"""A Slurm job's requeues: the ledger that keeps failures apart from planned requeues, and
which nodes a requeued job leaves out.

The ledger (``<run_dir>/slurm/requeues.jsonl``, one line per requeue) is what the retry budget
counts: ``SLURM_RESTART_COUNT`` counts every requeue, and a run that saves at each time limit
would spend its failure budget on planned restarts. Exclusions follow Slurm's own mechanism:
after ``scontrol requeue`` the pending job gets ``ExcNodeList`` (and a smaller ``NumNodes``
when it may shrink), which Slurm refuses for a running job.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LEDGER = Path("slurm") / "requeues.jsonl"


def read_ledger(run_dir: Path, job_id: str | None = None) -> list[dict[str, Any]]:
    path = run_dir / LEDGER
    if not path.exists():
        return []
    entries = []
    for line in path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:  # a torn last line from a killed writer
            continue
        if job_id is None or entry.get("job_id") == job_id:
            entries.append(entry)
    return entries


def append_ledger(run_dir: Path, entry: dict[str, Any]) -> None:
    """Record a requeue; on a disk that cannot take it (full), say so and go on: the requeue
    itself must not fail (its budget then counts one failure short)."""
    path = run_dir / LEDGER
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write(json.dumps({**entry, "time": time.time()}) + "\n")
    except OSError as exc:
        print(f"requeues: not recorded in {path}: {exc}", file=sys.stderr, flush=True)


def failures_used(run_dir: Path, job_id: str) -> int:
    return sum(1 for e in read_ledger(run_dir, job_id) if e.get("kind") == "failure")


def excluded_so_far(run_dir: Path, job_id: str) -> list[str]:
    entries = read_ledger(run_dir, job_id)
    return list(entries[-1].get("exclude", [])) if entries else []


@dataclass(frozen=True)
class Exclusion:
    exclude: tuple[str, ...]  # the requeued job's whole ExcNodeList
    nodes: int  # its node count
    note: str  # what was excluded, shrunk or refused, and why

    def scontrol_updates(self, job_nodes: int, cpus_per_task: int, already: list[str]) -> str:
        """``scontrol update`` arguments, one update per ';' ("" when nothing changes).

        Shrinking takes two: Slurm keeps the node count its CPU count implies, so the CPU and
        task counts go down first (one task per node), then the node count."""
        if list(self.exclude) == sorted(already) and self.nodes == job_nodes:
            return ""
        first = [f"ExcNodeList={','.join(self.exclude)}"] if self.exclude else []
        if self.nodes == job_nodes:
            return " ".join(first)
        first += [f"NumCPUs={self.nodes * cpus_per_task}", f"NumTasks={self.nodes}"]
        return " ".join(first) + f";NumNodes={self.nodes}"


def plan_exclusion(
    failed: list[str],
    already: list[str],
    *,
    launch_nodes: int,
    min_nodes: int | None,
    partition_nodes: int,
    max_excluded: int,
) -> Exclusion:
    """Leave ``failed`` nodes out of the requeued job, within two caps: at most
    ``max_excluded`` per job, and never so many that the partition has fewer nodes left than
    the job needs (``min_nodes``, else ``launch_nodes``): a job must not exclude itself out of
    existence. The job shrinks (down to ``min_nodes``) only when the nodes left are too few."""
    needed = min_nodes or launch_nodes
    exclude, notes = sorted(set(already)), []
    for node in sorted(set(failed) - set(already)):
        if len(exclude) >= max_excluded:
            notes.append(f"not excluding {node}: launch.slurm.max_excluded_nodes={max_excluded}")
        elif partition_nodes - len(exclude) - 1 < needed:
            notes.append(
                f"not excluding {node}: the partition would have "
                f"{partition_nodes - len(exclude) - 1} node(s) left for a job that needs "
                f"{needed} (launch.slurm.min_nodes lets a job shrink)"
            )
        else:
            exclude.append(node)
            notes.append(f"excluding {node}")
    nodes = max(needed, min(launch_nodes, partition_nodes - len(exclude)))
    if nodes < launch_nodes:
        notes.append(f"shrinking to {nodes} of {launch_nodes} node(s)")
    return Exclusion(tuple(sorted(exclude)), nodes, "; ".join(notes))
