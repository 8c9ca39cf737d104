"""P8: how long a restart takes next to a fresh start of the same job, with and without standby
workers (``launch.standby``).

Each repetition launches the tiny job under ``python -m launch local`` with ft_launcher,
measures launch -> first step (a fresh start: the standby's own imports included), then kills
a random rank's worker with SIGKILL at a random moment after the first save and measures kill
-> the new attempt's first step, both on this process's host clock, from what it sees itself
(the worker processes, ``steps.jsonl`` growing). P8 = recovery / fresh start, medians over
the repetitions; standby and plain repetitions alternate. The attempt record's recovery ledger
of the last repetition shows where the time went.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from launch.processes import rank_workers
from pretrain.context.run_dir import RunDir

REPO = Path(__file__).resolve().parents[1]
BOOT = time.CLOCK_BOOTTIME
FIRST_SAVE = 4  # steps; the kill lands after it, so the recovery restores


def _lines(path: Path) -> int:
    try:
        return len(path.read_text().splitlines())
    except FileNotFoundError:
        return 0


def wait_for_lines(steps: Path, count: int, job: subprocess.Popen, deadline: float) -> float:
    """Until ``steps`` has ``count`` lines; the host clock when it was seen."""
    while _lines(steps) < count:
        if job.poll() is not None or time.time() > deadline:
            raise RuntimeError(f"the job never reached step {count} (exit {job.poll()})")
        time.sleep(0.02)
    return time.clock_gettime(BOOT)


def kill_and_watch(
    run_dir: Path, job: subprocess.Popen, rng: random.Random, timeout_s: float = 180
) -> tuple[float, float, int]:
    """After the first save, at a random moment of the next ~5 steps (a step, a save or a
    commit), SIGKILL a random rank's worker; (kill, first step of the new attempt) on the host
    clock as this process saw them, and the rank killed."""
    steps = RunDir(run_dir).steps_metrics
    deadline = time.time() + timeout_s
    wait_for_lines(steps, FIRST_SAVE + 1, job, deadline)
    time.sleep(rng.uniform(0.0, 0.8))
    victims = rank_workers(run_dir)
    rank = rng.randrange(len(victims))
    old = {p.pid for p in victims.values()}
    killed_at = time.clock_gettime(BOOT)
    victims[rank].send_signal(signal.SIGKILL)
    seen_lines = None
    while time.time() < deadline:
        if job.poll() is not None:
            raise RuntimeError(f"the job ended ({job.returncode}) before it recovered")
        lines = _lines(steps)
        if seen_lines is None:
            fresh = rank_workers(run_dir).get(0)
            if fresh is not None and fresh.pid not in old:
                seen_lines = lines  # the new rank 0 exists: its first step is the next line
        elif lines > seen_lines:
            return killed_at, time.clock_gettime(BOOT), rank
        time.sleep(0.02)
    raise RuntimeError("no first step after the kill")


def launch_job(
    data: str, root: Path, run_id: str, standby: bool, steps: int, log: Path
) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "launch",
        "local",
        "--nproc=2",
        "--max-restarts=1",
        "recipe=gpt_tiny",
        f"data.paths=[{data}]",
        "train.micro_batch_size=2",
        "train.global_batch_size=8",
        f"train.train_steps={steps}",
        f"checkpoint.save_interval={FIRST_SAVE}",
        "launch.backend=ft_launcher",
        f"launch.standby={str(standby).lower()}",
        f"output_dir={root}",
        f"run_id={run_id}",
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    with log.open("w") as sink:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=sink, stderr=sink, text=True)


def one_recovery(data: str, root: Path, run_id: str, standby: bool, seed: int) -> dict[str, Any]:
    run_dir = root / run_id
    root.mkdir(parents=True, exist_ok=True)
    launched = time.clock_gettime(BOOT)
    job = launch_job(data, root, run_id, standby, 16, root / f"{run_id}.log")
    try:
        first = wait_for_lines(RunDir(run_dir).steps_metrics, 1, job, time.time() + 300)
        killed, recovered, rank = kill_and_watch(run_dir, job, random.Random(seed))
        code = job.wait(timeout=300)
    finally:
        if job.poll() is None:
            job.kill()
    if code != 0:
        raise RuntimeError(f"{run_id}: exited {code}; see {root / f'{run_id}.log'}")
    record = json.loads(RunDir(run_dir).attempts_dir.joinpath("attempt-01.json").read_text())
    return {
        "fresh_s": first - launched,
        "recovery_s": recovered - killed,
        "rank": rank,
        "ledger": record.get("rto"),
    }


def bench_recovery(work: Path, data: str, reps: int) -> dict[str, Any]:
    """P8, with and without standby workers, alternating."""
    seeds = random.Random(0x5EED).sample(range(1 << 16), reps)
    runs: dict[str, list[dict[str, Any]]] = {"standby": [], "plain": []}
    for rep, seed in enumerate(seeds):
        for mode in ("standby", "plain"):
            run = one_recovery(data, work / "p8", f"{mode}-{rep}", mode == "standby", seed)
            runs[mode].append(run)
            print(
                f"[bench] P8 {mode} rep {rep} (seed {seed}): fresh {run['fresh_s']:.2f} s, "
                f"recovery {run['recovery_s']:.2f} s",
                file=sys.stderr,
            )
    return {mode: _summary(found) for mode, found in runs.items()}


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ratios = sorted(r["recovery_s"] / r["fresh_s"] for r in runs)
    return {
        "P8": ratios[len(ratios) // 2],
        "P8_min": ratios[0],
        "P8_max": ratios[-1],
        "fresh_s": sorted(r["fresh_s"] for r in runs)[len(runs) // 2],
        "recovery_s": sorted(r["recovery_s"] for r in runs)[len(runs) // 2],
        "ledger": runs[-1]["ledger"],
    }
