"""How the drill starts one training job: torchrun on this machine, or a Slurm batch job.

Each launch writes the job's whole output to a log file (never a pipe: a SIGKILLed rank can
leave helper processes holding a pipe open, and reading it would block forever).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import psutil

log = logging.getLogger(__name__)
SLURM_TERMINAL = frozenset(
    {
        "COMPLETED",
        "FAILED",
        "CANCELLED",
        "TIMEOUT",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "BOOT_FAIL",
        "DEADLINE",
        "PREEMPTED",
    }
)


class DrillError(RuntimeError):
    """The drill cannot run as asked (missing tool, unusable output dir, failed submit)."""


@dataclass(frozen=True)
class LaunchSpec:
    run_dir: Path  # <output_dir>/<run_id>
    overrides: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class LaunchResult:
    spec: LaunchSpec
    returncode: int
    start: float  # wall clock (time.time) when the launch began
    end: float  # ... and when the job had ended
    leftover_pids: tuple[int, ...] | None = None  # None: not observable (remote nodes)
    job_id: str | None = None


class Launcher(Protocol):
    nproc: int

    def launch(self, spec: LaunchSpec) -> LaunchResult: ...


def _job_env(extra: dict[str, str]) -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **extra}


def processes_mentioning(text: str) -> tuple[int, ...]:
    """Live processes whose command line names ``text`` (a run's output dir)."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if any(text in arg for arg in proc.info["cmdline"] or []):
                found.append(proc.info["pid"])
        except (psutil.Error, TypeError):
            continue
    return tuple(found)


@dataclass
class LocalLauncher:
    """``torchrun --standalone --nproc-per-node N -m pretrain ...`` in a new session."""

    nproc: int
    cwd: Path
    timeout_s: float = 900.0

    def command(self, spec: LaunchSpec) -> list[str]:
        # torchrun as a module of this interpreter: an air-gapped GPU node's system python3
        # has torch but its console scripts may be elsewhere on PATH, or nowhere.
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={self.nproc}",
            "-m",
            "pretrain",
            *spec.overrides,
        ]

    def launch(self, spec: LaunchSpec) -> LaunchResult:
        spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        start = time.time()
        with spec.log_path.open("w") as out:
            proc = subprocess.Popen(
                self.command(spec),
                cwd=self.cwd,
                env=_job_env(spec.env),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            code = self._wait(proc)
        end = time.time()
        leftovers = processes_mentioning(f"output_dir={spec.run_dir.parent}")
        return LaunchResult(spec, code, start, end, leftovers)

    def _wait(self, proc: subprocess.Popen) -> int:
        try:
            return proc.wait(timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            log.error("launch exceeded %.0f s: killing its process group", self.timeout_s)
            os.killpg(proc.pid, signal.SIGKILL)
            return proc.wait()
        except BaseException:  # Ctrl-C or SIGTERM of the caller: the job (its own session) too
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise


@dataclass
class SlurmLauncher:
    """One ``python -m launch slurm`` submission per launch, polled until the job ends.

    The job itself must not requeue (``launch.slurm.max_requeues=0``): the drill's relaunch loop
    makes that decision, so each relaunch can carry its own fault schedule.
    """

    nproc: int
    cwd: Path
    timeout_s: float = 1800.0
    poll_s: float = 2.0

    def __post_init__(self) -> None:
        missing = [t for t in ("sbatch", "scontrol") if shutil.which(t) is None]
        if missing:
            raise DrillError(
                f"--launcher slurm: {' and '.join(missing)} not found on PATH. Run the drill on "
                "a Slurm login node (for a local test cluster: `bash tests/slurm/cluster_up.sh` "
                "then `source $MCORE_RECIPES_SLURM_ROOT/env.sh`), or use --launcher local."
            )

    def overrides(self, spec: LaunchSpec) -> list[str]:
        return [
            *spec.overrides,
            "launch.nodes=1",
            f"launch.nproc_per_node={self.nproc}",
            "launch.slurm.max_requeues=0",
        ]

    def launch(self, spec: LaunchSpec) -> LaunchResult:
        start = time.time()
        job_id = self._submit(spec)
        state, code = self._wait(job_id)
        end = time.time()
        self._collect_log(spec, job_id, state)
        return LaunchResult(spec, code, start, end, None, job_id)

    def _submit(self, spec: LaunchSpec) -> str:
        cmd = [sys.executable, "-m", "launch", "slurm", *self.overrides(spec)]
        proc = subprocess.run(
            cmd, cwd=self.cwd, env=_job_env(spec.env), capture_output=True, text=True, timeout=300
        )
        job_id = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
        if proc.returncode != 0 or not job_id.isdigit():
            raise DrillError(
                f"python -m launch slurm failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
            )
        log.info("submitted Slurm job %s for %s", job_id, spec.run_dir)
        return job_id

    def _wait(self, job_id: str) -> tuple[str, int]:
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            info = scontrol_job(job_id)
            if info.get("JobState") in SLURM_TERMINAL:
                return info["JobState"], int(info.get("ExitCode", "1:0").split(":")[0])
            time.sleep(self.poll_s)
        subprocess.run(["scancel", job_id], capture_output=True, timeout=60)
        raise DrillError(
            f"Slurm job {job_id} did not end within {self.timeout_s:.0f} s "
            f"(cancelled): {scontrol_job(job_id)}"
        )

    @staticmethod
    def _collect_log(spec: LaunchSpec, job_id: str, state: str) -> None:
        spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        parts = sorted((spec.run_dir / "slurm").glob(f"{job_id}-restart-*.log"))
        with spec.log_path.open("w") as out:
            out.write(f"# Slurm job {job_id} ended {state}\n")
            for part in parts:
                out.write(part.read_text(errors="replace"))


def scontrol_job(job_id: str) -> dict[str, str]:
    proc = subprocess.run(
        ["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=60
    )
    return dict(re.findall(r"(\w+)=(\S*)", proc.stdout))


def make_launcher(kind: str, nproc: int, cwd: Path, timeout_s: float) -> Launcher:
    if kind == "local":
        return LocalLauncher(nproc, cwd, timeout_s)
    if kind == "slurm":
        return SlurmLauncher(nproc, cwd, timeout_s)
    raise DrillError(f"unknown launcher {kind!r} (local or slurm)")
