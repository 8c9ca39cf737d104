"""parallel.elastic under ``launch slurm``: the batch script a user submits (one step per node
under the supervisor, Slurm told not to end the job for a failed node), read as bash and as
text, and the refusals that come before it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from launch.slurm.elastic import RENDEZVOUS, node_command
from tests.helpers import REPO

ELASTIC = [
    "recipe=gpt_tiny",
    "parallel.elastic=true",
    "parallel.tp=1",
    "launch.backend=ft_launcher",
    "launch.nodes=3",
    "launch.min_nodes=1",
    "launch.nproc_per_node=1",
    "train.global_batch_size=24",
]


def _dry_run(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "launch", "slurm", "--dry-run", "--out", str(tmp_path / "dry"),
         *ELASTIC, *extra, f"output_dir={tmp_path}", "run_id=el"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_the_batch_script_runs_one_supervised_step_per_node(tmp_path: Path) -> None:
    proc = _dry_run(tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    script = (tmp_path / "dry" / "el" / "slurm" / "el.sbatch").read_text()
    assert not (tmp_path / "el").exists()  # a dry run writes nothing into the run dir
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    assert "#SBATCH --nodes=3\n" in script and "#SBATCH --no-kill\n" in script
    assert "-m launch.slurm.elastic --config" in script
    assert "srun --nodes=1 --ntasks=1 --nodelist=@NODE@" in script
    assert f"{RENDEZVOUS} --nproc-per-node=1" in script and "--nnodes=" not in script
    # resiliency.max_restarts (2) plus one restart per node the job may lose (2); a grow's
    # emergency save gets resiliency.emergency_save_timeout_s (120) and 30 s for its step
    assert "--max-restarts=4" in script and "--workers-stop-timeout=150 " in script
    # a supervisor killed from outside leaves no node step behind
    assert 'squeue -h -s -j "$SLURM_JOB_ID"' in script
    # the worker entrypoint tells its launcher when the job stops (the batch shell's mark)
    assert "export MCORE_RECIPES_ELASTIC=1" in script and "-m launch.standby.worker" in script
    stop_mark = '--stop-mark "$RUN_DIR/attempts/spares/${SLURM_JOB_ID}-${RESTART}-stopping"'
    # the mark: made (its folder, the file) on the warning signal and on a Ctrl-C; read once
    assert stop_mark in script and script.count("-stopping") == 5


@pytest.mark.parametrize(
    "extra, expected",
    [
        (["launch.slurm.container_image=nvcr.io/nvidia/pytorch:25.01-py3"],
         "does not run with launch.slurm.container_image yet"),
        (["launch.slurm.spare_nodes=1"], "set neither"),
    ],
)  # fmt: skip
def test_what_cannot_resize_under_slurm_is_refused(
    tmp_path: Path, extra: list[str], expected: str
) -> None:
    proc = _dry_run(tmp_path, *extra)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert expected in proc.stderr and not (tmp_path / "el").exists()


def test_a_node_step_gets_its_node_and_its_rendezvous() -> None:
    step = ["srun", "--nodelist=@NODE@", "launcher", RENDEZVOUS, "-m", "x"]
    rendezvous = ["--nnodes=1:2", "--rdzv-backend=c10d"]
    assert node_command(step, "node7", rendezvous) == [
        "srun", "--nodelist=node7", "launcher", "--nnodes=1:2", "--rdzv-backend=c10d", "-m", "x",
    ]  # fmt: skip


def test_an_unchecked_launcher_release_is_refused() -> None:
    from launch.elastic import check_launcher_release
    from recipes import ConfigError

    check_launcher_release("0.4.1")
    with pytest.raises(ConfigError, match=r"0\.4\.x only so far \(installed: 0\.7\.0;"):
        check_launcher_release("0.7.0")
