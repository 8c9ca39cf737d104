"""The GPU check for an air-gapped node: one command, one GPU, about five minutes, no network.

    python3 -m bench.gpu_check [--wheels .whl] [--out DIR] [--only NAMES] [--dry-run]

On the node it installs the wheels ``make gpu-wheels`` carried (``pip --no-index --no-deps
--target``) and this checkout's own entry points, uses the node's torch, and measures through
the public CLI (``python -m pretrain``, one process per run, faults from this process):

- ``peaks``: this GPU's bf16 matmul TFLOP/s, device-to-host bandwidth into pinned memory, the
  run directory's disk writing fsync'd bytes;
- ``throughput``: a Llama-3.2-1B-shaped model (GQA, SwiGLU, RMSNorm, RoPE, seq 4096, bf16,
  megatron-core's local spec, the distributed optimizer at world 1) with ``perf.recompute``
  none, selective and full: tokens/s, TFLOP/s (pretrain/model/flops.py), MFU against the measured
  and the datasheet peak, the step-time spread;
- ``plan``: ``--plan --json`` for that model against the run's allocator figures;
- ``resume``: ``train.deterministic=true``; a reference run, a second run SIGKILLed (its
  process group, from here) once a save is committed, its relaunch; losses and grad norms
  compared bit for bit; the async saves' blocked time against bytes / D2H bandwidth (first
  and steady), the step-time slowdown while the writer runs; the relaunch saves
  synchronously: sync save / the raw fsync'd write of the same bytes;
- ``equivalence``: ``python -m drill.equivalence --controls`` at one rank on a small Llama-shaped
  model: the run killed after its step-2 save and resumed in a fresh process holds the
  uninterrupted run's whole state byte for byte (parameters, fp32 main parameters, Adam's
  moments and step, the gradients after the resumed step, the CUDA RNG among the others),
  and each deliberately broken restore is named;
- ``recipe``: ``llama3_8b`` shrunk to fit one GPU (layers, CP=1): ``--plan`` and 10 steps.

Prints one JSON document and writes it (``gpu_check.json``, after every section) and every
run's output (``gpu_check.log``) to ``--out`` or ``$OUT``. ``--dry-run`` runs every section
at toy size on the CPU (no wheels), to prove the path before a GPU is spent on it.
Exit 0 when every section ran and the resume was exact.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # `python3 bench/gpu_check.py` too, not only `-m bench.gpu_check`

from pretrain.context.run_dir import RunDir, iter_jsonl, last_by_step, read_jsonl  # noqa: E402

SECTIONS = ("peaks", "resume", "equivalence", "throughput", "plan", "recipe")
WARMUP = 5  # steps left out of every median (allocator, autotuning, the first save's setup)
GIB = float(1 << 30)

# The settings train.deterministic applies (pretrain/platform/rng.py), for the report.
DETERMINISM = (
    "train.deterministic=true: megatron-core deterministic_mode (embedding backward without "
    "atomics), torch.use_deterministic_algorithms(True, warn_only=True), cuDNN deterministic, "
    "CUBLAS_WORKSPACE_CONFIG=:4096:8, NCCL_ALGO=Ring"
)


def mfu(tflops_per_device: float, peak_tflops: float | None) -> float | None:
    """Model FLOPs utilisation: achieved model TFLOP/s over a peak (None: no peak known)."""
    return tflops_per_device / peak_tflops if peak_tflops else None


def spread(values: list[float]) -> dict[str, float]:
    """Median, 10th/90th percentile, min, max and the coefficient of variation."""
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]  # noqa: E731
    mean = statistics.fmean(ordered)
    cv = statistics.pstdev(ordered) / mean if len(ordered) > 1 and mean else 0.0
    return {
        "median": statistics.median(ordered),
        "p10": pick(0.1),
        "p90": pick(0.9),
        "min": ordered[0],
        "max": ordered[-1],
        "cv": cv,
    }


class Shape:
    """The runs' sizes: real on a GPU, toy on the CPU (--dry-run); one place for both."""

    def __init__(self, dry_run: bool, steps: int, resume_steps: int = 40) -> None:
        self.dry_run = dry_run
        self.throughput_steps = 8 if dry_run else steps
        self.resume_steps, self.save_every, self.kill_after = (
            (12, 4, 6) if dry_run else (resume_steps, 15, 17)
        )
        self.recipe_steps = 3 if dry_run else 10

    def device(self) -> list[str]:
        return ["train.device=cpu", "train.precision=fp32"] if self.dry_run else []

    def throughput_model(self) -> list[str]:
        """Llama 3.2 1B's shape (1.24B parameters, tied embeddings) at seq 4096."""
        if self.dry_run:
            dims = (2, 64, 4, 2, 256, 128, 512)
        else:
            dims = (16, 2048, 32, 8, 8192, 4096, 128256)
        return [
            *llama_shape("llama3_1b", dims),
            "model.share_embeddings_and_output_weights=true",
            *single_gpu_layout(),
            *mock_data(),
            "train.micro_batch_size=1",
            f"train.global_batch_size={2 if self.dry_run else 4}",
            f"train.train_steps={self.throughput_steps}",
            "checkpoint.enabled=false",
            "logging.log_interval=5",
            *self.device(),
        ]

    def resume_model(self) -> list[str]:
        """A ~190M Llama-shaped model whose ~2.6 GB checkpoint a local disk writes in seconds."""
        dims = (2, 64, 4, 2, 128, 64, 512) if self.dry_run else (8, 1024, 16, 4, 4096, 2048, 32768)
        return [
            *llama_shape("llama3_190m", dims),
            *single_gpu_layout(),
            *mock_data(),
            "train.micro_batch_size=2",
            f"train.global_batch_size={4 if self.dry_run else 32}",
            f"train.train_steps={self.resume_steps}",
            "train.deterministic=true",
            "scheduler.warmup_steps=5",
            f"checkpoint.save_interval={self.save_every}",
            "checkpoint.async_save=true",
            "checkpoint.keep_last=10",  # the committed step of both runs stays, to compare
            "checkpoint.fingerprint=true",  # a restore proves it continues from the saved state
            "logging.log_interval=5",
            *self.device(),
        ]

    def equivalence_model(self) -> list[str]:
        """A small Llama-shaped model: every dump of its whole state is tens of MB. The gate
        sets the steps and the saves itself."""
        dims = (2, 64, 4, 2, 128, 64, 512) if self.dry_run else (2, 512, 8, 4, 1024, 1024, 8192)
        return [
            *llama_shape("llama3_small", dims),
            *single_gpu_layout(),
            *mock_data(),
            "train.micro_batch_size=2",
            "train.global_batch_size=4",
            "train.deterministic=true",
            *self.device(),
        ]

    def recipe_model(self) -> list[str]:
        """llama3_8b as shipped, shrunk to one GPU: 2 of its 32 layers, CP=1, mock data."""
        toy = (
            [
                "model.hidden_size=64",
                "model.num_attention_heads=4",
                "model.num_query_groups=2",
                "model.ffn_hidden_size=128",
                "model.seq_length=64",
                "model.padded_vocab_size=512",
            ]
            if self.dry_run
            else ["model.padded_vocab_size=128256"]  # Llama 3's vocabulary, on byte ids
        )
        return [
            "recipe=llama3_8b",
            "model.num_layers=2",
            *toy,
            *single_gpu_layout(),
            *mock_data(),
            "train.global_batch_size=2",
            f"train.train_steps={self.recipe_steps}",
            "checkpoint.enabled=false",
            "logging.log_interval=1",
            *self.device(),
        ]


def llama_shape(name: str, dims: tuple[int, ...]) -> list[str]:
    """llama3_8b's recipe (GQA, SwiGLU, RMSNorm, RoPE) at other sizes: (layers, hidden, heads,
    query groups, ffn, seq, padded vocab)."""
    layers, hidden, heads, groups, ffn, seq, vocab = dims
    return [
        "recipe=llama3_8b",
        f"model.name={name}",
        f"model.num_layers={layers}",
        f"model.hidden_size={hidden}",
        f"model.num_attention_heads={heads}",
        f"model.num_query_groups={groups}",
        f"model.ffn_hidden_size={ffn}",
        f"model.seq_length={seq}",
        f"model.padded_vocab_size={vocab}",
    ]


def single_gpu_layout() -> list[str]:
    return [
        "parallel.tp=1",
        "parallel.pp=1",
        "parallel.cp=1",
        "launch.nodes=1",
        "launch.nproc_per_node=1",
        "launch.gpus_per_node=1",
    ]


def mock_data() -> list[str]:
    """megatron-core's MockGPTDataset: no corpus or tokenizer files on the node."""
    return [
        "data.kind=mock",
        "data.tokenizer=byte",
        "data.tokenizer_path=null",
        "data.vocab_size=null",
        "data.paths=[]",
    ]


class Check:
    """Runs the sections, keeps the report and the log, and owns the wall-clock budget."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out: Path = args.out
        # A fresh folder per check: a run id found again would resume, not start.
        self.runs = args.runs_dir / time.strftime("%Y%m%d-%H%M%S")
        self.shape = Shape(args.dry_run, args.steps, args.resume_steps)
        self.deadline = time.monotonic() + args.budget_s
        self.started = time.time()
        self.log_path = self.out / "gpu_check.log"
        self.env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.report: dict[str, Any] = {"schema": 1, "dry_run": args.dry_run, "sections": {}}
        self.port = 29500 + os.getpid() % 1000

    # -- the report ------------------------------------------------------------------------
    def note(self, text: str) -> None:
        line = f"[gpu_check {time.time() - self.started:7.1f}s] {text}"
        print(line, file=sys.stderr, flush=True)
        with self.log_path.open("a") as stream:
            stream.write(line + "\n")

    def save(self) -> None:
        self.report["wall_s"] = round(time.time() - self.started, 1)
        (self.out / "gpu_check.json").write_text(json.dumps(self.report, indent=2) + "\n")

    def section(self, name: str, body: Callable[[], dict[str, Any]]) -> None:
        if self.args.only and name not in self.args.only:
            return
        if self.remaining() < 20:
            self.report["sections"][name] = {"status": "skipped", "why": "out of time"}
            self.save()
            return
        self.note(f"section {name}")
        began = time.monotonic()
        try:
            result = {"status": "ok", **body()}
        except Exception as exc:  # noqa: BLE001 - a broken section must not lose the others
            result = {"status": "failed", "error": f"{type(exc).__name__}: {exc}"}
            self.note(traceback.format_exc())
        result["wall_s"] = round(time.monotonic() - began, 1)
        self.report["sections"][name] = result
        self.save()

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    # -- running the CLI -------------------------------------------------------------------
    def pretrain(
        self, overrides: list[str], run_id: str | None = None, output_dir: Path | None = None
    ) -> subprocess.Popen:
        self.port += 1
        cmd = [
            sys.executable,
            "-m",
            "pretrain",
            *overrides,
            f"output_dir={output_dir or self.runs}",
        ]
        if run_id:
            cmd.append(f"run_id={run_id}")
        self.note("$ " + " ".join(cmd[1:]))
        env = dict(self.env, MASTER_PORT=str(self.port))
        log = self.log_path.open("a")
        return subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def finish(self, proc: subprocess.Popen, what: str) -> int:
        try:
            code = proc.wait(timeout=max(5.0, self.remaining()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise RuntimeError(f"{what}: out of the check's time budget") from None
        self.note(f"{what}: exit {code}")
        return code

    def train(self, overrides: list[str], run_id: str, output_dir: Path | None = None) -> Path:
        code = self.finish(self.pretrain(overrides, run_id, output_dir), run_id)
        if code != 0:
            raise RuntimeError(f"run {run_id} exited {code} (see gpu_check.log)")
        return (output_dir or self.runs) / run_id

    def plan(self, overrides: list[str]) -> dict[str, Any]:
        gpu = [] if self.args.dry_run else ["--gpu", "h200-141gb"]
        cmd = [sys.executable, "-m", "pretrain", *overrides, "--plan", "--json", *gpu]
        self.note("$ " + " ".join(cmd[1:]))
        proc = subprocess.run(
            cmd, cwd=REPO, env=self.env, capture_output=True, text=True, timeout=self.remaining()
        )
        with self.log_path.open("a") as stream:
            stream.write(proc.stderr)
        if proc.returncode not in (0, 1):  # 1: does not fit, still a plan
            raise RuntimeError(f"--plan exited {proc.returncode}: {proc.stderr[-500:]}")
        return json.loads(proc.stdout)

    # -- the sections ----------------------------------------------------------------------
    def peaks(self) -> dict[str, Any]:
        from importlib.metadata import version

        import torch

        result: dict[str, Any] = {
            "device": device_name(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "megatron_core": version("megatron-core"),
            "python": sys.version.split()[0],
        }
        if self.args.dry_run:
            result["matmul_tflops"] = matmul_tflops(torch.float32, 256, "cpu")
        else:
            result["matmul_tflops"] = matmul_tflops(torch.bfloat16, 8192, "cuda")
            result["d2h_pinned_gbps"] = d2h_pinned_gbps(1 << 31)
        result["disk_fsync_gbps"] = disk_write_gbps(
            self.runs, 1 << (24 if self.args.dry_run else 31)
        )
        result["datasheet_bf16_tflops"] = datasheet_peak()
        self.report["peaks"] = result
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the runs get the whole GPU
        return result

    def equivalence(self) -> dict[str, Any]:
        """The resume-equivalence gate on this device (its verdict lines as the result)."""
        out = self.runs / "equivalence"
        cmd = [sys.executable, "-m", "drill.equivalence", "--out", str(out), "--nproc", "1",
               "--step", "2", "--controls", *self.shape.equivalence_model()]  # fmt: skip
        self.note("$ " + " ".join(cmd[1:]))
        with self.log_path.open("a") as log:
            proc = subprocess.run(
                cmd, cwd=REPO, env=self.env, stdout=subprocess.PIPE, stderr=log, text=True,
                timeout=max(5.0, self.remaining()),
            )  # fmt: skip
        verdict = proc.stdout.splitlines()
        if proc.returncode != 0:
            raise RuntimeError(f"drill.equivalence exited {proc.returncode}: {verdict}")
        return {"equal": any("EQUAL" in line for line in verdict), "verdict": verdict}

    def throughput(self) -> dict[str, Any]:
        measured = self.report.get("peaks", {}).get("matmul_tflops")
        runs = {}
        for recompute in ("none", "selective", "full"):
            run_id = f"tput-{recompute}"
            steps = self.shape.throughput_steps
            if recompute != "none":  # the baseline gets the most steps; the others are ratios
                steps = max(WARMUP + 5, steps * 2 // 3)
            model = [*self.shape.throughput_model(), f"train.train_steps={steps}"]
            run_dir = self.train([*model, f"perf.recompute={recompute}"], run_id)
            runs[recompute] = throughput_of(read_steps(run_dir), measured, datasheet_peak())
        self.report["throughput_memory"] = memory_of(read_steps(self.runs / "tput-none"))
        return {"model": "llama3.2-1b shape, seq 4096, mbs 1, gbs 4", "by_recompute": runs}

    def plan_vs_real(self) -> dict[str, Any]:
        plan = self.plan(self.shape.throughput_model())
        real = self.report.get("throughput_memory")
        if real is None:
            raise RuntimeError("needs the throughput section's run")
        return compare_plan(plan, real)

    def resume(self) -> dict[str, Any]:
        model = self.shape.resume_model()
        reference = self.train(model, "resume-ref")
        killed = self.kill_after_save(model, "resume-kill")
        step = self.shape.save_every
        # One state saved by two processes (the reference and the run killed later): its
        # payload files must be byte-identical, or the save itself is not deterministic.
        same_save = compare_step_files(
            layout_of(reference).step_dir(step),
            layout_of(self.runs / "resume-kill").step_dir(step),
        )
        ref_steps = read_steps(reference)
        variants = {}
        if self.args.diagnose:  # the same relaunch without the DDP overlaps, on a copy
            shutil.copytree(self.runs / "resume-kill", self.runs / "no-overlap" / "resume-kill")
        relaunch_began = time.time()
        relaunched = self.train([*model, "checkpoint.async_save=false"], "resume-kill")
        if self.args.diagnose:
            no_overlap = [
                *model,
                "perf.overlap_param_gather=false",
                "perf.overlap_grad_reduce=false",
            ]
            alt = self.train(no_overlap, "resume-kill", self.runs / "no-overlap")
            variants["no_ddp_overlap"] = compare_trajectories(ref_steps, read_attempts(alt)[-1])
        attempts = read_attempts(relaunched)
        if len(attempts) != 2:
            raise RuntimeError(f"expected the killed attempt and its relaunch, got {len(attempts)}")
        before, after = attempts
        result = {
            "settings": DETERMINISM,
            "killed": killed,
            "resumed_from_step": min(after) - 1,
            "before_kill": compare_trajectories(ref_steps, before),
            "after_resume": compare_trajectories(ref_steps, after),
            "same_state_saved_twice": same_save,
            # checkpoint.fingerprint: the relaunch's live state after the load is the saved one
            "restored_state_matches_save": "state fingerprint matches the save"
            in self.log_path.read_text(),
            "relaunch_variants": variants,
        }
        result["bit_exact"] = (
            result["before_kill"]["bit_exact"] and result["after_resume"]["bit_exact"]
        )
        result["async_save"] = self.save_costs(reference, asynchronous=True)
        result["sync_save"] = self.save_costs(relaunched, asynchronous=False, since=relaunch_began)
        return result

    def kill_after_save(self, model: list[str], run_id: str) -> dict[str, Any]:
        """SIGKILL the whole run (trainer and writer) once step save_every is committed and the
        loop is past it: the moment comes from the file system, not from the trainer."""
        proc = self.pretrain(model, run_id)
        run_dir = self.runs / run_id
        committed = committed_marker(run_dir, self.shape.save_every)
        while proc.poll() is None:
            steps = read_steps(run_dir)
            if committed.exists() and max(steps, default=0) >= self.shape.kill_after:
                os.killpg(proc.pid, signal.SIGKILL)
                break
            if self.remaining() < 10:
                os.killpg(proc.pid, signal.SIGKILL)
                raise RuntimeError("the run to kill never committed its save in time")
            time.sleep(0.05)
        code = self.finish(proc, f"{run_id} (killed)")
        steps = read_steps(run_dir)
        if code != -signal.SIGKILL:
            raise RuntimeError(f"{run_id} ended by itself (exit {code}) before the kill")
        return {"exit": code, "at_step": max(steps), "committed_step": self.shape.save_every}

    def save_costs(self, run_dir: Path, asynchronous: bool, since: float = 0.0) -> dict[str, Any]:
        """The saves of the attempt that began after ``since`` (metrics/checkpoints.jsonl)."""
        peaks = self.report.get("peaks", {})
        records = read_jsonl(RunDir(run_dir).checkpoint_metrics)
        records = [r for r in records if r["time"] >= since]
        saves = [r for r in records if r["tier"] == "persistent"]
        steps = read_steps(run_dir)
        # Sizing the staging buffers: once per attempt, on the training thread, before its
        # first save (resiliency/checkpoint/hook.py): part of what a first save costs.
        staging = sum(r["blocked_s"] for r in records if r["tier"] == "staging")
        out: dict[str, Any] = {"staging_blocked_s": staging, "saves": []}
        layout = layout_of(run_dir)
        kept = layout.published_steps()
        # Every step of a run has the same bytes; older ones were collected (keep_last).
        size = tree_bytes(layout.step_dir(kept[-1])) if kept else None
        for index, save in enumerate(saves):
            entry: dict[str, Any] = {
                "step": save["step"],
                "tier": save["tier"],
                "first_of_attempt": index == 0,
                "blocked_s": save["blocked_s"],
                "bytes": size,
            }
            if asynchronous and size and peaks.get("d2h_pinned_gbps"):
                entry["blocked_over_d2h"] = save["blocked_s"] / (
                    size / 1e9 / peaks["d2h_pinned_gbps"]
                )
            if not asynchronous and size and peaks.get("disk_fsync_gbps"):
                entry["save_over_raw_write"] = save["blocked_s"] / (
                    size / 1e9 / peaks["disk_fsync_gbps"]
                )
            out["saves"].append(entry)
        if asynchronous:
            out["slowdown_while_writing"] = writer_slowdown(run_dir, steps, saves)
        return out

    def recipe(self) -> dict[str, Any]:
        overrides = self.shape.recipe_model()
        plan = self.plan(overrides)
        run_dir = self.train(overrides, "recipe-llama3_8b")
        steps = read_steps(run_dir)
        return {
            "overrides": overrides,
            "plan_total_gib": plan["memory"][0]["total"] / GIB,
            "plan_params": plan["total_params"],
            "steps": len(steps),
            "losses": [steps[s]["loss"] for s in sorted(steps)],
            "memory": memory_of(steps),
        }


# -- measurements in this process --------------------------------------------------------------
def device_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def datasheet_peak() -> float | None:
    from recipes.gpus import device_peak_tflops

    return device_peak_tflops(device_name(), "bf16")


def matmul_tflops(dtype: Any, n: int, device: str) -> float:
    """Dense matmul TFLOP/s: the mean of ten n x n x n products after three warm-ups."""
    import torch

    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    for _ in range(3):
        a @ b
    sync(device)
    began = time.perf_counter()
    for _ in range(10):
        a @ b
    sync(device)
    return 10 * 2 * n**3 / (time.perf_counter() - began) / 1e12


def d2h_pinned_gbps(size: int) -> float:
    """Device-to-host copy into pinned memory, GB/s (the best of three)."""
    import torch

    src = torch.empty(size, dtype=torch.uint8, device="cuda")
    dst = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    best = float("inf")
    for _ in range(3):
        torch.cuda.synchronize()
        began = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - began)
    return size / best / 1e9


def disk_write_gbps(directory: Path, size: int) -> float:
    """Writing ``size`` bytes in 16 MiB chunks and fsync'ing them, GB/s, on ``directory``'s
    file system (where the checkpoints go)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "raw-write.bin"
    chunk = os.urandom(1 << 24)
    began = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for _ in range(size // len(chunk)):
            os.write(fd, chunk)
        os.fsync(fd)
    finally:
        os.close(fd)
    seconds = time.perf_counter() - began
    path.unlink()
    return size / seconds / 1e9


def sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


# -- reading what the runs wrote ---------------------------------------------------------------
def read_steps(run_dir: Path) -> dict[int, dict[str, Any]]:
    """Step -> record; a relaunch's record replaces the killed attempt's for the same step."""
    return last_by_step(RunDir(run_dir).steps_metrics)


def read_attempts(run_dir: Path) -> list[dict[int, dict[str, Any]]]:
    """steps.jsonl cut where the step number goes back: one step -> record map per attempt."""
    attempts: list[dict[int, dict[str, Any]]] = []
    last = None
    for record in iter_jsonl(RunDir(run_dir).steps_metrics):
        if last is None or record["step"] <= last:
            attempts.append({})
        attempts[-1][record["step"]] = record
        last = record["step"]
    return attempts


def layout_of(run_dir: Path) -> Any:
    """The run's checkpoint layout (resiliency/storage/layout.py names the step dirs)."""
    from resiliency.storage.layout import RunLayout

    return RunLayout.from_run_dir(run_dir)


def committed_marker(run_dir: Path, step: int) -> Path:
    """The file whose appearance publishes ``step``."""
    from resiliency.storage.layout import COMMITTED_NAME

    return layout_of(run_dir).step_dir(step) / COMMITTED_NAME


def compare_step_files(a: Path, b: Path) -> dict[str, Any]:
    """sha256 of each payload file of two step dirs (the manifest names the run: left out)."""
    from resiliency.storage.layout import payload_files

    if not a.exists() or not b.exists():
        return {"compared": False, "why": "a step dir was collected"}
    names_a, names_b = sorted(payload_files(a)), sorted(payload_files(b))
    differing = [n for n in names_a if n in names_b and file_sha256(a / n) != file_sha256(b / n)]
    return {
        "compared": True,
        "files": len(names_a),
        "same_names": names_a == names_b,
        "identical": names_a == names_b and not differing,
        "differing_files": differing[:20],
    }


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        while chunk := stream.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def throughput_of(
    steps: dict[int, dict[str, Any]], measured_peak: float | None, datasheet: float | None
) -> dict[str, Any]:
    timed = [steps[s] for s in sorted(steps) if s > WARMUP]
    tflops = statistics.median(r["tflops_per_device"] for r in timed)
    return {
        "steps_timed": len(timed),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
        "tflops_per_device": tflops,
        "mfu_vs_measured_peak": mfu(tflops, measured_peak),
        "mfu_vs_datasheet": mfu(tflops, datasheet),
        "step_time_s": spread([r["step_time_s"] for r in timed]),
    }


def memory_of(steps: dict[int, dict[str, Any]]) -> dict[str, float]:
    """The run's allocator figures (GiB): its peak, and what stays allocated between steps."""
    logged = [steps[s]["memory_gib"] for s in sorted(steps) if steps[s].get("memory_gib")]
    if not logged:
        return {}
    keys = {k for m in logged for k in m}
    return {k: max(m.get(k, 0.0) for m in logged) for k in sorted(keys)}


def compare_plan(plan: dict[str, Any], real: dict[str, float]) -> dict[str, Any]:
    """--plan's static part (weights + grads + optimizer) against what stays allocated between
    steps, its activations against the peak above that, as real / planned."""
    stage = plan["memory"][0]
    static_plan = (stage["weights"] + stage["grads"] + stage["optimizer"]) / GIB
    result: dict[str, Any] = {
        "plan_gib": {k: stage[k] / GIB for k in ("weights", "grads", "optimizer", "activations")},
        "plan_static_gib": static_plan,
        "real_gib": real,
    }
    if "allocated_gib" in real:
        activations = real["max_allocated_gib"] - real["allocated_gib"]
        result["real_static_over_plan"] = real["allocated_gib"] / static_plan
        result["real_activations_over_plan"] = activations / (stage["activations"] / GIB)
        result["real_peak_over_plan"] = real["max_allocated_gib"] / (
            static_plan + stage["activations"] / GIB
        )
    return result


def compare_trajectories(
    reference: dict[int, dict[str, Any]], resumed: dict[int, dict[str, Any]]
) -> dict[str, Any]:
    """Losses and grad norms of every step both runs have, compared bit for bit."""
    common = sorted(set(reference) & set(resumed))
    loss = [abs(reference[s]["loss"] - resumed[s]["loss"]) for s in common]
    grad = [abs(reference[s]["grad_norm"] - resumed[s]["grad_norm"]) for s in common]
    differing = [s for s, a, b in zip(common, loss, grad) if a or b]
    return {
        "steps_compared": len(common),
        "bit_exact": bool(common) and not differing,
        "first_differing_step": differing[0] if differing else None,
        "max_abs_loss_diff": max(loss, default=None),
        "max_abs_grad_norm_diff": max(grad, default=None),
        # (step, |loss diff|, |grad norm diff|) of the first compared steps: where it starts
        "first_steps": [[s, a, b] for s, a, b in list(zip(common, loss, grad))[:3]],
    }


def writer_slowdown(
    run_dir: Path, steps: dict[int, dict[str, Any]], saves: list[dict[str, Any]]
) -> dict[str, Any] | None:
    """Median step time while an async writer ran (from the save's end to its COMMITTED
    file's mtime, the file system's clock) over the median of the other timed steps."""
    windows = []
    for save in saves:
        committed = committed_marker(run_dir, save["step"])
        if committed.exists():
            windows.append((save["time"], committed.stat().st_mtime))
    during, other = [], []
    for step in sorted(steps):
        if step <= WARMUP:
            continue
        record = steps[step]
        busy = any(start <= record["time"] <= end for start, end in windows)
        (during if busy else other).append(record["step_time_s"])
    if not during or not other:
        return {"steps_while_writing": len(during), "ratio": None}
    return {
        "steps_while_writing": len(during),
        "ratio": statistics.median(during) / statistics.median(other),
    }


# -- wheels --------------------------------------------------------------------------------
def install_wheels(wheels: Path, site: Path) -> None:
    """Install the carried wheels and this checkout's entry points (the hook registry) into
    ``site``, offline, and put it on this process's and the runs' path."""
    found = sorted(str(w) for w in wheels.glob("*.whl"))
    if not found:
        raise SystemExit(f"gpu_check: no wheels in {wheels}: run `make gpu-wheels` where PyPI is")
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps"]
    pip += ["--no-compile", "--no-cache-dir", "--upgrade", "--target", str(site)]
    subprocess.run([*pip, *found], check=True)
    write_entry_points(site)
    sys.path.insert(0, str(site))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(site), os.environ.get("PYTHONPATH")])
    )


def write_entry_points(site: Path) -> None:
    """The checkout's package metadata, entry points only (the trainer finds its hooks through
    them, pretrain/train/hooks.py), so the code runs from the checkout without building it (a pip
    install of the project would need setuptools and copy the tree)."""
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    info = site / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n"
    )
    groups = project.get("entry-points", {})
    lines = [
        f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items())
        for group, eps in groups.items()
    ]
    (info / "entry_points.txt").write_text("\n".join(lines))


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=Path(os.environ.get("OUT") or REPO / "runs" / "gpu-check")
    )
    parser.add_argument(
        "--runs-dir", type=Path, default=None, help="run dirs (default: <out>/../gpu-check-runs)"
    )
    parser.add_argument(
        "--wheels", type=Path, default=None, help="install these wheels first (.whl)"
    )
    parser.add_argument("--site", type=Path, default=Path("/tmp/gpu-check-site"))
    parser.add_argument(
        "--only", type=lambda s: set(s.split(",")), default=None, help=",".join(SECTIONS)
    )
    parser.add_argument("--steps", type=int, default=30, help="steps per throughput run")
    parser.add_argument("--budget-s", type=float, default=330.0, help="wall-clock budget")
    parser.add_argument(
        "--dry-run", action="store_true", help="every section at toy size on the CPU"
    )
    parser.add_argument(
        "--diagnose",
        action="store_true",
        help="resume: also relaunch a copy without the DDP overlaps",
    )
    parser.add_argument("--resume-steps", type=int, default=40, help="steps of each resume run")
    args = parser.parse_args(argv)
    args.runs_dir = args.runs_dir or Path(
        "/tmp/gpu-check-runs" if os.environ.get("OUT") else REPO / "runs" / "gpu-check-runs"
    )
    return args


def main(argv: list[str]) -> int:
    args = parse(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.wheels:
        install_wheels(args.wheels, args.site)
    sys.path.insert(0, str(REPO))
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible; --dry-run runs it on the CPU", file=sys.stderr)
        return 2
    check = Check(args)
    check.report["command"] = " ".join([Path(sys.executable).name, "-m", "bench.gpu_check", *argv])
    check.section("peaks", check.peaks)
    check.section("resume", check.resume)
    check.section("equivalence", check.equivalence)
    check.section("throughput", check.throughput)
    check.section("plan", check.plan_vs_real)
    check.section("recipe", check.recipe)
    check.save()
    print(json.dumps(check.report, indent=2))
    sections = check.report["sections"].values()
    exact = check.report["sections"].get("resume", {}).get("bit_exact", args.only is not None)
    return 0 if all(s["status"] == "ok" for s in sections) and exact else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
