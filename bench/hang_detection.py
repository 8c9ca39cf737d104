"""How fast does ft_launcher notice a hung rank, relative to the configured timeout?

Runs gpt_tiny on 2 CPU ranks under ``python -m launch local`` (launch.backend=ft_launcher) with
rank 1 blocking forever in step ``--hang-step`` of the first launcher round, then reads the
failed attempt's record and prints a JSON report:

* ``timeout_s``: the step-section timeout in force (learned from the first steps, floored);
* ``monitor_open_s`` / ``monitor_ratio``: how long the section had been open when the rank
  monitor fired, and that over the timeout (>= 1; the excess is the monitor's check interval);
* ``detection_s`` / ``detection_ratio``: hang start -> the launcher saw the group fail;
* the rest of the RTO breakdown (teardown, restart, init, load, first step) and the culprit.

    python bench/hang_detection.py [--floor 4] [--check-interval 0.5] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def prepare_corpus(workdir: Path) -> str:
    warnings.simplefilter("ignore")  # library import chatter; the report is the output
    sys.path.insert(0, str(REPO))  # also run as a script (its own process, see run_job)
    # project imports after the path is set: this file also runs as a script
    from pretrain.prepare import dataset_prefix, stdlib_documents
    from pretrain.prepare import prepare_corpus as prepare
    from pretrain.tokenizer import build_tokenizer

    prefix = str(workdir / "corpus" / "stdlib")
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    prepare(stdlib_documents(1 << 20), prefix, build_tokenizer("byte"))
    return dataset_prefix(prefix)


def run_job(args: argparse.Namespace, workdir: Path, data: str) -> subprocess.CompletedProcess:
    overrides = [
        "recipe=gpt_tiny",
        f"data.paths=[{data}]",
        f"output_dir={workdir / 'runs'}",
        "run_id=hang",
        f"train.train_steps={args.steps}",
        "train.micro_batch_size=2",
        "train.global_batch_size=8",
        "checkpoint.save_interval=4",
        "launch.backend=ft_launcher",
        "resiliency.ft.learn_after_steps=3",
        f"resiliency.ft.timeout_floor_s={args.floor}",
        f"resiliency.ft.check_interval_s={args.check_interval}",
        f"train.fault=hang@{args.hang_step}:1/0",
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "launch", "local", "--nproc=2", *overrides],
        cwd=REPO,
        env=env,
        text=True,
        capture_output=True,
        timeout=600,
    )


def report(record: dict[str, Any], returncode: int) -> dict[str, Any]:
    culprit = record.get("first_failing_rank")
    monitor = [m for m in record.get("monitor_timeouts", []) if m["rank"] == culprit] or record.get(
        "monitor_timeouts", []
    )
    rto = record.get("rto", {})
    out: dict[str, Any] = {
        "launcher_exit": returncode,
        "culprit_rank": culprit,
        "cause": record.get("failure_cause"),
    }
    if monitor:
        timeout = monitor[0]["timeout_s"]
        out.update(
            timeout_s=timeout,
            monitor_open_s=monitor[0]["open_s"],
            monitor_ratio=round(monitor[0]["open_s"] / timeout, 3),
        )
        if rto.get("detection_s") is not None:
            out["detection_ratio"] = round(rto["detection_s"] / timeout, 3)
    out["rto"] = {k: v for k, v in rto.items() if k.endswith("_s")}
    out["lost_steps"] = record.get("lost_steps")
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--floor", type=float, default=4.0, help="resiliency.ft.timeout_floor_s")
    parser.add_argument(
        "--check-interval",
        type=float,
        default=0.5,
        help="resiliency.ft.check_interval_s (rank monitor and launcher)",
    )
    parser.add_argument("--hang-step", type=int, default=7)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--keep", type=Path, default=None, help="work dir to keep (default: temp)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.keep or Path(tmp)
        proc = run_job(args, workdir, prepare_corpus(workdir))
        path = workdir / "runs" / "hang" / "attempts" / "attempt-01.json"
        if not path.exists():
            sys.stderr.write(proc.stderr[-4000:])
            return 1
        print(json.dumps(report(json.loads(path.read_text()), proc.returncode), indent=2))
    return 0 if proc.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
