"""Training-blocked time of a node-local save vs. a persistent save of the same state, one run.

One training run on 2 CPU ranks (DP=2, distributed optimizer) saves persistently every
``--persistent-every`` steps (synchronously: the loop waits for shards, checksums, manifest,
fsync and the atomic rename) and to the local tier on every other step (this rank's shard plus
the peer's replica, checksummed while written). The loop records how long each save blocked it
(``metrics/checkpoints.jsonl``); this prints the median/min/max per tier, the bytes each tier
wrote per step, and the ratio local / persistent. Both tiers save the same model and optimizer
state at neighbouring steps of the same process, so machine drift affects both alike.

    python bench/local_tier.py [--hidden 512] [--steps 16] [--persistent-every 4] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from pretrain.context.run_dir import RunDir, read_jsonl

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.hang_detection import prepare_corpus  # noqa: E402


def run_job(args: argparse.Namespace, workdir: Path, data: str) -> None:
    overrides = [
        "recipe=gpt_tiny",
        f"data.paths=[{data}]",
        f"output_dir={workdir / 'runs'}",
        "run_id=bench",
        f"train.train_steps={args.steps}",
        "train.micro_batch_size=2",
        "train.global_batch_size=4",
        "parallel.tp=1",
        "optimizer.use_distributed_optimizer=true",
        f"model.hidden_size={args.hidden}",
        f"model.ffn_hidden_size={4 * args.hidden}",
        f"checkpoint.save_interval={args.persistent_every}",
        "checkpoint.local.interval=1",
        f"checkpoint.local.dir={workdir / 'local'}",
        "checkpoint.local.replication_jump=1",
        "resiliency.watch.steps=0",
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    torchrun = Path(sys.executable).with_name("torchrun")
    proc = subprocess.run(
        [str(torchrun), "--standalone", "--nproc-per-node=2", "-m", "pretrain", *overrides],
        cwd=REPO,
        env=env,
        text=True,
        capture_output=True,
        timeout=1800,
    )
    if proc.returncode != 0:
        raise SystemExit(f"training failed ({proc.returncode}):\n{proc.stderr[-4000:]}")


def step_bytes(workdir: Path) -> dict[str, int]:
    run = workdir / "runs" / "bench"
    steps = sorted(RunDir(run).steps_dir.glob("step-*"))
    manifest = json.loads((steps[-1] / "manifest.json").read_text())
    local = sorted((workdir / "local").glob("node-*/bench/*/iter_*_local.pt"))
    newest = max(int(p.name.split("_")[1]) for p in local)
    return {
        "persistent": sum(f["bytes"] for f in manifest["files"]),
        "local": sum(p.stat().st_size for p in local if int(p.name.split("_")[1]) == newest),
    }


def summarize(workdir: Path) -> dict[str, Any]:
    records = read_jsonl(RunDir(workdir / "runs" / "bench").checkpoint_metrics)
    sizes = step_bytes(workdir)
    tiers: dict[str, Any] = {}
    for tier in ("local", "persistent"):
        times = [r["blocked_s"] for r in records if r["tier"] == tier]
        tiers[tier] = {
            "saves": len(times),
            "median_s": statistics.median(times),
            "min_s": min(times),
            "max_s": max(times),
            "bytes": sizes[tier],
        }
    ratio = tiers["local"]["median_s"] / tiers["persistent"]["median_s"]
    return {"tiers": tiers, "local_over_persistent": ratio}


def print_table(summary: dict[str, Any]) -> None:
    print(f"{'tier':<11} {'saves':>5} {'median s':>9} {'min s':>7} {'max s':>7} {'MiB/step':>9}")
    for tier, row in summary["tiers"].items():
        print(
            f"{tier:<11} {row['saves']:>5} {row['median_s']:>9.3f} {row['min_s']:>7.3f} "
            f"{row['max_s']:>7.3f} {row['bytes'] / 2**20:>9.1f}"
        )
    print(f"blocked time, local / persistent (medians): {summary['local_over_persistent']:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512, help="model.hidden_size (state size)")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--persistent-every", type=int, default=4)
    parser.add_argument("--keep", type=Path, help="work in this dir and keep it")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON too")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.keep or Path(tmp)
        run_job(args, workdir, prepare_corpus(workdir))
        summary = summarize(workdir)
    print_table(summary)
    if args.json:
        print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
