"""One run's directory, ``<output_dir>/<run_id>/``: the one owner of every entry's name and
of the JSON-lines files in it. Torch-free (the storage layer and the CLIs read runs without it).

    config.yaml            the config as trained (rank 0, every attempt)
    launch-config.yaml     the config a launcher resolved and pinned (every rank, every requeue)
    run.json               the run's identity (id, first launch)
    latest.json            the newest published step
    steps/                 published checkpoints (resiliency.storage.layout names the steps)
    attempts/              one record per attempt (standby/: reaped workers; spares/: claims)
    LEASE, LEASE.generation
    metrics/steps.jsonl    one line per step (rank 0)
    metrics/eval.jsonl     one line per validation
    metrics/checkpoints.jsonl   how long each save kept the loop waiting
    metrics/*.prom         Prometheus textfiles
    tensorboard/           event files
    data-cache/            megatron's dataset index cache
    ft_timeouts.json       the fault-tolerance timeouts observed so far

A JSON-lines file has one writer, which appends whole lines; a reader skips a line it cannot
decode (the torn last line of a killed writer).
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STEPS_JSONL = "steps.jsonl"
EVAL_JSONL = "eval.jsonl"
CHECKPOINTS_JSONL = "checkpoints.jsonl"


@dataclass(frozen=True)
class RunDir:
    path: Path

    @classmethod
    def of(cls, output_dir: str | Path, run_id: str) -> RunDir:
        return cls(Path(output_dir) / run_id)

    @property
    def run_id(self) -> str:
        return self.path.name

    @property
    def output_dir(self) -> Path:
        return self.path.parent

    @property
    def config_path(self) -> Path:
        return self.path / "config.yaml"

    @property
    def launch_config_path(self) -> Path:
        return self.path / "launch-config.yaml"

    @property
    def config_files(self) -> tuple[Path, Path]:
        """Where a run's config is recorded: the trainer's record first, then the launch pin."""
        return self.config_path, self.launch_config_path

    @property
    def markers(self) -> tuple[Path, ...]:
        """Entries only a run dir has: any of them makes a folder a run dir."""
        return self.steps_dir, self.attempts_dir, self.run_json_path

    @property
    def launcher_log(self) -> Path:
        """``launch local``'s copy of its launcher's output (launch/kept_log.py)."""
        return self.path / "launch-local.log"

    @property
    def run_json_path(self) -> Path:
        return self.path / "run.json"

    @property
    def latest_path(self) -> Path:
        return self.path / "latest.json"

    @property
    def steps_dir(self) -> Path:
        return self.path / "steps"

    @property
    def attempts_dir(self) -> Path:
        return self.path / "attempts"

    @property
    def standby_exits_dir(self) -> Path:
        """A standby server's record of each worker it reaped (``<host>.jsonl``)."""
        return self.attempts_dir / "standby"

    @property
    def spares_dir(self) -> Path:
        """Hot spares (``launch.slurm.spare_nodes``), per job and requeue (``<job>``: its id
        and restart count): the claims on its spare nodes (``<job>-claim-<k>.json``), the one
        node leaving in each in-job round (``<job>-round-<r>``) and the mark of a job that is
        stopping (``<job>-stopping``)."""
        return self.attempts_dir / "spares"

    def spare_claim(self, job: str, slot: int) -> Path:
        return self.spares_dir / f"{job}-claim-{slot}.json"

    def spare_round(self, job: str, round_: int) -> Path:
        return self.spares_dir / f"{job}-round-{round_}"

    def job_stopping_mark(self, job: str) -> Path:
        return self.spares_dir / f"{job}-stopping"

    @property
    def lease_path(self) -> Path:
        return self.path / "LEASE"

    @property
    def lease_generation_path(self) -> Path:
        """The last lease generation handed out: survives a released (deleted) LEASE."""
        return self.path / "LEASE.generation"

    @property
    def metrics_dir(self) -> Path:
        """JSON-lines metrics and Prometheus textfiles (node-exporter reads every ``*.prom``)."""
        return self.path / "metrics"

    @property
    def steps_metrics(self) -> Path:
        return self.metrics_dir / STEPS_JSONL

    @property
    def eval_metrics(self) -> Path:
        return self.metrics_dir / EVAL_JSONL

    @property
    def checkpoint_metrics(self) -> Path:
        return self.metrics_dir / CHECKPOINTS_JSONL

    @property
    def tensorboard_dir(self) -> Path:
        return self.path / "tensorboard"

    @property
    def data_cache_dir(self) -> Path:
        return self.path / "data-cache"

    @property
    def init_source_dir(self) -> Path:
        """checkpoint.init_from=s3://...: the source step downloaded (a run layout of its own)."""
        return self.path / "init-source"

    @property
    def timeouts_path(self) -> Path:
        return self.path / "ft_timeouts.json"


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    """One whole line at the end of ``path`` (its folder made if needed), or none: a write
    the disk could not take whole (ENOSPC) is cut back off, so the next record does not land
    on a torn line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    line = (json.dumps(record) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        end = os.lseek(fd, 0, os.SEEK_END)
        try:
            if os.write(fd, line) != len(line):
                raise OSError(errno.ENOSPC, f"{path}: only part of a line fitted")
        except OSError:
            os.ftruncate(fd, end)
            raise
    finally:
        os.close(fd)


def iter_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    """The records of a JSON-lines file in order; none if it is missing or unreadable, a line
    that does not decode skipped (a killed writer's torn last line)."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            yield record


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return list(iter_jsonl(path))


def last_by_step(path: Path) -> dict[int, dict[str, Any]]:
    """step -> the last record logged for it (a step redone after a restart keeps the last)."""
    return {int(r["step"]): r for r in iter_jsonl(path) if "step" in r}
