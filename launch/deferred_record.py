"""The record of an attempt whose run dir did not answer, written once it does.

``launch local`` gave the node up (:mod:`launch.stuck_node`) without touching the run dir: what
the post-mortem needs (the launcher's events, the verdict) is spooled to the node's own
temporary directory, and a detached ``python -m launch.deferred_record SPOOL`` waits on the
storage (blocking is its job), then finalizes the launch's attempts and adds the verdict to the
newest one.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from launch.stuck_node import NodeVerdict
from pretrain.platform.logs import setup_logging
from resiliency.monitor.postmortem import LauncherEvents, finalize_attempts, read_record
from resiliency.storage.attempts import recorded_attempts
from resiliency.storage.layout import RunLayout, atomic_write_json

log = logging.getLogger(__name__)
SPOOL_DIR = Path(tempfile.gettempdir()) / "mcore-recipes-pending"


def spool_record(
    run_dir: Path, after_attempt: int, events: LauncherEvents, tokens_per_step: int,
    verdict: NodeVerdict,
) -> Path:  # fmt: skip
    """What the recorder needs, on this node's own disk; the recorder started, detached."""
    SPOOL_DIR.mkdir(parents=True, exist_ok=True)
    spool = SPOOL_DIR / f"{run_dir.name}-{os.getpid()}-{int(verdict.at)}.json"
    spool.write_text(json.dumps({
        "run_dir": str(run_dir), "after_attempt": after_attempt,
        "events": dataclasses.asdict(events), "tokens_per_step": tokens_per_step,
        "verdict": dataclasses.asdict(verdict),
    }))  # fmt: skip
    with spool.with_suffix(".log").open("a") as out:
        subprocess.Popen(
            [sys.executable, "-m", "launch.deferred_record", str(spool)], stdin=subprocess.DEVNULL,
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    return spool


def record(spool: Path, data: dict) -> int:
    """Blocks until the run dir answers; then finalizes the attempts the launch left and
    adds the node's verdict to the newest one (``data``: the spool's content)."""
    layout = RunLayout.from_run_dir(Path(data["run_dir"]))
    events = LauncherEvents(**data["events"])
    attempts = [a for a in recorded_attempts(layout) if a > data["after_attempt"]]
    finalize_attempts(layout, attempts, events, data["tokens_per_step"])
    if attempts:
        newest = attempts[-1]
        merged = {**read_record(layout, newest), "node_unhealthy": data["verdict"]}
        atomic_write_json(layout.attempt_path(newest), merged)
        log.info("attempt %d recorded with the node's verdict in %s", newest, layout.attempts_dir)
    else:
        log.info("no attempt of this launch to record in %s", layout.attempts_dir)
    spool.unlink()
    return 0


def main(argv: list[str]) -> int:
    setup_logging("INFO")
    parser = argparse.ArgumentParser(
        prog="python -m launch.deferred_record",
        description="Record the attempt a stuck node left, once its run dir answers.",
    )
    parser.add_argument("spool", type=Path, help="the record spooled by launch local")
    spool = parser.parse_args(argv).spool
    try:
        data = json.loads(spool.read_text())
    except (OSError, ValueError) as exc:
        log.error("not a spooled record: %s (%s)", spool, exc)
        return 2
    return record(spool, data)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
