"""A GPU job's preflight as the batch script runs it: ``python -m launch.slurm.preflight`` as a
process on this machine, and the rendered script's preflight section around it (srun standing
in for Slurm). Here torch is a CPU build, so the environment cannot run a GPU job."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from launch.slurm.script import ScriptInputs, render_sbatch
from pretrain.context import exit_codes
from recipes import load_config
from tests.helpers import REPO

PYTHON = Path(sys.executable)


@pytest.fixture(scope="module", autouse=True)
def cpu_torch() -> None:
    torch = pytest.importorskip("torch")
    if torch.version.cuda is not None:
        pytest.skip("torch here is a CUDA build: these tests are about one that is not")


def _preflight(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(PYTHON), "-m", "launch.slurm.preflight", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
    )


def test_a_cpu_torch_is_refused_in_one_line_and_seconds() -> None:
    started = time.monotonic()
    proc = _preflight("--gpus", "1")
    elapsed = time.monotonic() - started
    assert proc.returncode == exit_codes.CONFIG_ERROR == 2, proc.stderr
    lines = (proc.stdout + proc.stderr).splitlines()
    assert len(lines) == 1, lines  # not a second line about the GPUs it cannot see
    assert lines[0].startswith("preflight on ") and "is not a CUDA build" in lines[0], lines
    assert elapsed < 30, elapsed


def test_the_batch_script_stops_the_job_before_it_trains() -> None:
    """The rendered preflight section, run by bash with an srun that runs its command here:
    the real preflight refuses this environment, and the script exits 2 (never requeued)
    before the node health check."""
    run_dir = Path("/shared/runs/r")
    inputs = ScriptInputs(
        config_path=run_dir / "launch-config.yaml",
        run_dir=run_dir,
        workdir=REPO,
        bin_dir=PYTHON.parent,
        code_commit=None,
        image_digest=None,
    )
    run = load_config(["recipe=llama3_8b", "run_id=r"])  # CP=2: Transformer Engine too
    script = render_sbatch(run, inputs)
    start = script.index("-- preflight\n")
    section = script[start : script.index("-- node health\n", start)].split("\n", 1)[1]
    srun = 'srun() { while [[ "$1" == --* ]]; do shift; done; "$@"; }'  # options: Slurm's
    driver = "\n".join(
        [f"cd {REPO}", "SIGNALED_BY= SLURM_NNODES=1 SLURM_CPUS_ON_NODE=2", srun, section,
         "echo reached the health check"]
    )  # fmt: skip
    proc = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", driver],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == exit_codes.CONFIG_ERROR, proc.stdout + proc.stderr
    assert "is not a CUDA build" in proc.stderr, proc.stderr
    assert "Transformer Engine does not import" in proc.stderr and "parallel.cp=2" in proc.stderr
    assert "preflight FAILED (exit 2)" in proc.stdout and "not requeued" in proc.stdout
    assert "reached the health check" not in proc.stdout
