"""The prepared GPU check (``make gpu-smoke``): one CUDA GPU, Transformer Engine, ~125M model.

1. bf16, 50 steps, validation every 25, checkpoints every 20: the uninterrupted reference;
2. the same run SIGKILLed before step 30, relaunched: resumes from step 20 and must reproduce
   the reference's losses bit for bit;
3. fp8 (``perf.fp8=hybrid``, delayed scaling) for 20 steps where the GPU supports it
   (compute capability >= 8.9: Ada, Hopper, Blackwell);
then prints tokens/s, TFLOP/s per device and MFU (median of the steps after the first 5) as
JSON. Exit 0 only if every part ran and the resume was exact.

    python -m bench.gpu_smoke [--steps 50] [--out runs/gpu-smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from pretrain.context.run_dir import RunDir, last_by_step
from pretrain.data.prepare.corpus import dataset_prefix, prepare_corpus, stdlib_documents
from pretrain.data.tokenizer import build_tokenizer

REPO = Path(__file__).resolve().parents[1]
WARMUP = 5  # steps left out of the throughput medians (compile, allocator, autotuning)


def base_overrides(data: str, out: Path, steps: int) -> list[str]:
    return [
        "recipe=gpt_125m",
        f"data.paths=[{data}]",
        f"output_dir={out}",
        "parallel.tp=1",
        f"train.train_steps={steps}",
        "train.micro_batch_size=4",
        "train.global_batch_size=32",
        "train.eval_interval=25",
        "train.eval_iters=4",
        "checkpoint.save_interval=20",
        "checkpoint.async_save=true",
        "scheduler.warmup_steps=10",
        "logging.log_interval=10",
        "launch.gpus_per_node=1",
    ]


def train(overrides: list[str], check: bool = True) -> subprocess.CompletedProcess:
    cmd = [
        str(Path(sys.executable).parent / "torchrun"),
        "--standalone",
        "--nproc-per-node=1",
        "-m",
        "pretrain",
        *overrides,
    ]
    proc = subprocess.run(
        cmd, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"}, text=True, capture_output=True
    )
    if check and proc.returncode != 0:
        raise RuntimeError(f"training failed ({proc.returncode}):\n{proc.stderr[-5000:]}")
    return proc


def steps_of(run_dir: Path) -> dict[int, dict[str, Any]]:
    return last_by_step(RunDir(run_dir).steps_metrics)


def throughput(run_dir: Path) -> dict[str, Any]:
    steps = [r for s, r in sorted(steps_of(run_dir).items()) if s > WARMUP]
    mfu = [r["mfu"] for r in steps if r.get("mfu") is not None]
    return {
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steps),
        "tflops_per_device": statistics.median(r["tflops_per_device"] for r in steps),
        "mfu": statistics.median(mfu) if mfu else None,
        "step_time_s": statistics.median(r["step_time_s"] for r in steps),
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "gpu-smoke")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu-smoke: no CUDA device visible; this check needs one GPU", file=sys.stderr)
        return 2
    started = time.time()
    prefix = str(args.out / "corpus" / "stdlib")
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    prepare_corpus(stdlib_documents(64 << 20), prefix, build_tokenizer("byte"))
    base = base_overrides(dataset_prefix(prefix), args.out, args.steps)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    reference, resumed = f"ref-{stamp}", f"resume-{stamp}"
    train([*base, f"run_id={reference}"])
    killed = train([*base, f"run_id={resumed}", "train.fault=kill@30"], check=False)
    train([*base, f"run_id={resumed}"])
    ref_steps, res_steps = steps_of(args.out / reference), steps_of(args.out / resumed)
    exact = [ref_steps[s]["loss"] for s in sorted(ref_steps)] == [
        res_steps[s]["loss"] for s in sorted(res_steps)
    ]
    report: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(),
        "bf16": throughput(args.out / reference),
        "killed_exit": killed.returncode,
        "resume_bit_exact": exact,
    }
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) >= (8, 9):
        fp8 = f"fp8-{stamp}"
        fp8_run = [*base, f"run_id={fp8}", "train.train_steps=20", "perf.fp8=hybrid"]
        train([*fp8_run, "train.eval_interval=null", "checkpoint.save_interval=null"])
        report["fp8"] = throughput(args.out / fp8)
    report["wall_s"] = round(time.time() - started, 1)
    print(json.dumps(report, indent=2))
    return 0 if exact and killed.returncode != 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
