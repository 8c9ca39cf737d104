"""P4: how fast a hung rank is caught in each section, and whether the record names it.

Runs gpt_tiny on 2 CPU ranks under ``python -m launch local`` (launch.backend=ft_launcher) and
SIGSTOPs a random rank (the whole process freezes, as a stuck node does) in one section per
scenario:

* ``step``: before a training step; ``sync save``: at the save point of step 8;
* ``async commit``: the same point of an async save, reached in the commit before step 9;
* ``restore``: round 0 is killed at step 6, round 1 stops while it restores step 4;
* ``eval``: in the validation after step 6 (validations at 2 and 4 taught its timeout);
* ``alive hang``: the rank blocks forever without stopping (stacks, not heartbeats, name it).

Per scenario: the section timeout in force, detection (the hung rank's last progress -> the
launcher saw the group fail), the goal max(3 x p99, floor) + 5 s from the section's persisted
observations, and whether ``first_failing_rank`` is the rank that was stopped. ``random`` stops
a random rank at a random moment from outside, ``--stops`` times in one run.

    python -m bench.hang_detection [--reps 1] [--stops 10] [--keep DIR]
    python -m bench P4 --full           # the same, in the benchmark table
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import psutil

from pretrain.context.run_dir import RunDir
from pretrain.data.prepare.corpus import dataset_prefix, stdlib_documents
from pretrain.data.prepare.corpus import prepare_corpus as prepare
from pretrain.data.tokenizer import build_tokenizer
from resiliency.monitor.timeouts import p99

REPO = Path(__file__).resolve().parents[1]
FLOOR_S, CHECK_S = 4.0, 0.5
# scenario -> (section the monitor must fire in, fault spec with {r} for the rank, overrides)
SCENARIOS: dict[str, tuple[str, str, list[str]]] = {
    "step": ("step", "stop@7:{r}/0", []),
    "sync save": ("checkpointing", "stop_save@8:{r}/0", []),
    "async commit": ("checkpointing", "stop_save@8:{r}/0", ["checkpoint.async_save=true"]),
    "restore": ("setup", "kill@6:0/0;stop_restore@4:{r}/1", []),
    "eval": ("eval", "stop_eval@6:{r}/0", ["train.eval_interval=2", "train.eval_iters=2"]),
    "alive hang": ("step", "hang@7:{r}/0", []),
}


def prepare_corpus(workdir: Path) -> str:
    warnings.simplefilter("ignore")  # library import chatter; the report is the output
    prefix = str(workdir / "corpus" / "stdlib")
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    prepare(stdlib_documents(1 << 20), prefix, build_tokenizer("byte"))
    return dataset_prefix(prefix)


def job_command(workdir: Path, data: str, steps: int, extra: list[str], restarts: int) -> list:
    overrides = [
        "recipe=gpt_tiny",
        f"data.paths=[{data}]",
        f"output_dir={workdir / 'runs'}",
        "run_id=hang",
        f"train.train_steps={steps}",
        "train.micro_batch_size=2",
        "train.global_batch_size=8",
        "checkpoint.save_interval=4",
        "launch.backend=ft_launcher",
        "resiliency.ft.learn_after_steps=3",
        f"resiliency.ft.timeout_floor_s={FLOOR_S}",
        f"resiliency.ft.check_interval_s={CHECK_S}",
        *extra,
    ]
    launch = [sys.executable, "-m", "launch", "local", "--nproc=2"]
    return [*launch, f"--max-restarts={restarts}", *overrides]


def job_env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def judge(record: dict[str, Any], section: str, rank: int, run_dir: Path) -> dict[str, Any]:
    """One hung attempt: timeout, detection, goal, and whether the right rank was named."""
    saved = json.loads(RunDir(run_dir).timeouts_path.read_text())["samples"][section]
    goal = max(3 * p99(saved), FLOOR_S) + 5
    monitor = [m for m in record.get("monitor_timeouts", []) if m["section"] == section]
    detection = (record.get("rto") or {}).get("detection_s")
    return {
        "section": section,
        "stopped_rank": rank,
        "named_rank": record.get("first_failing_rank"),
        "named_right": record.get("first_failing_rank") == rank,
        "rule": (record.get("hang") or {}).get("rule"),
        "timeout_s": min((m["timeout_s"] for m in monitor), default=None),
        "detection_s": detection,
        "goal_s": round(goal, 3),
        "goal_met": detection is not None and detection <= goal,
    }


def run_scenario(name: str, workdir: Path, data: str, rng: random.Random) -> dict[str, Any]:
    section, faults, extra = SCENARIOS[name]
    rank = rng.randrange(2)
    spec = faults.format(r=rank)
    cmd = job_command(workdir, data, 12, [*extra, f'train.fault="{spec}"'], restarts=2)
    proc = subprocess.run(cmd, cwd=REPO, env=job_env(), text=True, capture_output=True, timeout=600)
    run_dir = workdir / "runs" / "hang"
    records = _records(run_dir)
    hung = [r for r in records if r.get("monitor_timeouts")]
    if proc.returncode != 0 or not hung:
        raise RuntimeError(f"{name}: launcher exit {proc.returncode}\n{proc.stderr[-4000:]}")
    return judge(hung[0], section, rank, run_dir)


def _records(run_dir: Path) -> list[dict[str, Any]]:
    paths = sorted(RunDir(run_dir).attempts_dir.glob("attempt-[0-9][0-9].json"))
    return [json.loads(p.read_text()) for p in paths]


# ---------------------------------------------------------------- stops from outside
def workers(root: Path, restart: int) -> dict[int, psutil.Process]:
    """rank -> worker process of launcher round ``restart`` (from the workers' environment)."""
    found = {}
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if "pretrain" not in cmdline or not any(str(root) in part for part in cmdline):
            continue
        try:
            environ = proc.environ()
        except psutil.Error:
            continue
        if environ.get("TORCHELASTIC_RESTART_COUNT") == str(restart) and "RANK" in environ:
            found[int(environ["RANK"])] = proc
    return found


def stop_a_random_rank(
    root: Path, restart: int, steps: Path, rng: random.Random, nproc: int = 2
) -> int:
    """Once round ``restart`` trains, wait a random moment and SIGSTOP a random rank."""
    deadline = time.time() + 120
    while time.time() < deadline:
        found = workers(root, restart)
        if len(found) == nproc and steps.exists():
            before = len(steps.read_text().splitlines())
            time.sleep(1.0)
            if len(steps.read_text().splitlines()) > before:  # this round is training
                break
        time.sleep(0.2)
    else:
        raise RuntimeError(f"round {restart} never started training")
    time.sleep(rng.uniform(0.0, 1.5))  # a step, a save or a commit: wherever it lands
    rank = rng.randrange(nproc)
    found[rank].send_signal(signal.SIGSTOP)
    return rank


def run_random(workdir: Path, data: str, stops: int, rng: random.Random) -> dict[str, Any]:
    extra = ["checkpoint.async_save=true", "checkpoint.save_interval=3"]
    cmd = job_command(workdir, data, 20 + 12 * stops, extra, restarts=stops)
    run_dir = workdir / "runs" / "hang"
    log = workdir / "launcher.log"  # a file, not a pipe: an unread pipe stalls the launcher
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as sink:
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=job_env(), text=True, stdout=subprocess.DEVNULL, stderr=sink
        )
        try:
            stopped = [
                stop_a_random_rank(workdir, r, RunDir(run_dir).steps_metrics, rng)
                for r in range(stops)
            ]
            proc.wait(timeout=60 * stops + 300)
        finally:
            if proc.poll() is None:
                proc.kill()
    if proc.returncode != 0:
        raise RuntimeError(
            f"random stops: launcher exit {proc.returncode}\n{log.read_text()[-4000:]}"
        )
    records = _records(run_dir)[:stops]
    # The section whose timeout fired; "none" where the group failed before any did (a peer
    # that lost the stopped rank exited first).
    sections = [str((r.get("monitor_timeouts") or [{}])[0].get("section", "none")) for r in records]
    return {
        "named_right": sum(r.get("first_failing_rank") == s for r, s in zip(records, stopped)),
        "stops": stops,
        "sections": {s: sections.count(s) for s in set(sections)},
        "detection_s": [(r.get("rto") or {}).get("detection_s") for r in records],
        "undetermined": sum(r.get("first_failing_rank") == "undetermined" for r in records),
        "misnamed": [
            {"stopped": s, **{k: r.get(k) for k in ("attempt", "first_failing_rank", "hang")}}
            for r, s in zip(records, stopped)
            if r.get("first_failing_rank") != s
        ],
    }


def summarize(per_scenario: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    out = {}
    for name, runs in per_scenario.items():
        if not runs:
            continue
        detections = [r["detection_s"] for r in runs if r["detection_s"] is not None]
        out[name] = {
            "section": runs[0]["section"],
            "timeout_s": statistics.median(r["timeout_s"] for r in runs if r["timeout_s"]),
            "detection_s": statistics.median(detections) if detections else None,
            "goal_s": max(r["goal_s"] for r in runs),
            "goal_met": all(r["goal_met"] for r in runs),
            "named_right": f"{sum(r['named_right'] for r in runs)}/{len(runs)}",
            "rules": sorted({str(r["rule"]) for r in runs}),
        }
    return out


def bench(workdir: Path, data: str, reps: int, stops: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    per_scenario: dict[str, list[dict[str, Any]]] = {name: [] for name in SCENARIOS}
    for rep in range(reps):
        for index, name in enumerate(SCENARIOS):
            rep_dir = workdir / f"hang-{rep}-{index}"
            per_scenario[name].append(run_scenario(name, rep_dir, data, rng))
    result: dict[str, Any] = {"seed": seed, "sections": summarize(per_scenario)}
    if stops:
        result["random"] = run_random(workdir / "hang-random", data, stops, rng)
    return result


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=1, help="runs per scenario")
    parser.add_argument("--stops", type=int, default=10, help="random stops from outside")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--keep", type=Path, default=None, help="work dir to keep (default: temp)")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 30)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.keep or Path(tmp)
        result = bench(workdir, prepare_corpus(workdir), args.reps, args.stops, seed)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
