"""Jobs that make progress where they run, and one planner story, through the real CLIs.

Expected figures are computed here by hand from the recipes' published shapes, not by the
planner: Llama 3 70B has 70,557,900,800 parameters at the padded vocabulary 128,512 (h 8192,
80 layers, FFN 28672, 64 heads, 8 KV groups, untied embeddings):
  per layer 2*8192^2 + 2*8192*1024 (attention) + 3*8192*28672 (SwiGLU) + 2*8192 = 855,654,400
  x 80 + 2 * 128512 * 8192 (embedding, output) + 8192 (final norm) = 70,557,900,800,
so one bf16 + Adam version is 14 B/param = 987,810,611,200 B, 98.78 s at 10 GB/s.
"""

from __future__ import annotations

import math
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[3]
PARAMS_70B = 70_557_900_800
SAVE_70B_S = PARAMS_70B * 14 / 10e9  # 98.78 s at checkpoint.plan_bandwidth=10 GB/s
MTBF_70B_S = 50_000 * 3600 / 64  # plan_gpu_mtbf_h over 8 nodes x 8 GPUs
K8S = [
    "launch.k8s.image=registry/mcore:1",
    "launch.k8s.shared_pvc=ckpt",
    "launch.k8s.cpu=96",
    "launch.k8s.memory=1600Gi",
    "data.paths=[/checkpoints/data/llama3_text_document]",
    "data.tokenizer_path=/checkpoints/tokenizers/llama3",
    "output_dir=/checkpoints/runs",
]


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )


def slurm_dry_run(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    return cli("launch", "slurm", "--dry-run", f"output_dir={tmp_path}", "run_id=r", *overrides)


def pinned_interval(tmp_path: Path) -> int:
    return yaml.safe_load((tmp_path / "r" / "launch-config.yaml").read_text())["checkpoint"][
        "save_interval"
    ]


@pytest.mark.parametrize("recipe", ["llama3_8b", "llama3_70b", "mixtral_8x7b"])
def test_every_gpu_recipe_renders_a_slurm_job_that_makes_progress(
    recipe: str, tmp_path: Path
) -> None:
    """From a fresh clone, unedited: the job renders (its data is on the cluster, not here),
    and the interval "auto" resolved to is pinned as a number that fits twice in the limit."""
    out = slurm_dry_run(tmp_path, f"recipe={recipe}")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "would not make progress" not in out.stderr
    assert "dry run, rendered anyway" in out.stderr  # the missing data is said, not fatal
    interval = pinned_interval(tmp_path)
    assert isinstance(interval, int) and interval >= 1


def test_auto_is_youngs_interval_capped_by_the_time_limit(tmp_path: Path) -> None:
    """70B at a measured 60 s per step: Young's sqrt(2 x 98.78 s x 781 h) = 23,571 s = 393
    steps, but two intervals and a 300 s start must fit in 4 h: (14400 - 300) / 120 = 117."""
    young_steps = round(math.sqrt(2 * SAVE_70B_S * MTBF_70B_S) / 60)
    assert young_steps == 393
    out = slurm_dry_run(tmp_path, "recipe=llama3_70b", "train.step_time_s=60")
    assert out.returncode == 0, out.stderr[-2000:]
    assert pinned_interval(tmp_path) == 117
    longer = slurm_dry_run(
        tmp_path / "long", "recipe=llama3_70b", "train.step_time_s=60",
        "launch.slurm.time_limit=2-00:00:00",
    )  # fmt: skip
    assert longer.returncode == 0, longer.stderr[-2000:]
    assert pinned_interval(tmp_path / "long") == young_steps


def test_a_job_that_would_not_progress_is_refused_with_the_fix(tmp_path: Path) -> None:
    out = slurm_dry_run(
        tmp_path, "recipe=llama3_70b", "train.step_time_s=60", "checkpoint.save_interval=500",
        "launch.slurm.signal_grace_s=100",
    )  # fmt: skip
    assert out.returncode == 2, out.stderr[-2000:]
    error = [ln for ln in out.stderr.splitlines() if "would not make progress" in ln]
    assert len(error) == 1, out.stderr[-2000:]  # one line, both problems
    assert "checkpoint.save_interval<=117" in error[0]
    # the grace must cover the step (60 s) and an emergency save (98.78 s): 159 s
    assert "launch.slurm.signal_grace_s=159 or more" in error[0]
    assert "--skip-progress-check" in error[0]
    assert not (tmp_path / "r" / "slurm").exists()  # nothing rendered
    anyway = cli(
        "launch", "slurm", "--dry-run", "--skip-progress-check", f"output_dir={tmp_path}",
        "run_id=r", "recipe=llama3_70b", "checkpoint.save_interval=500",
    )  # fmt: skip
    assert anyway.returncode == 0, anyway.stderr[-2000:]
    assert pinned_interval(tmp_path) == 500  # a number is never replaced


def test_a_pytorchjob_is_judged_by_its_termination_grace(tmp_path: Path) -> None:
    ok = cli("launch", "k8s", "--dry-run", "recipe=llama3_70b", "run_id=r", *K8S)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "kind: PyTorchJob" in ok.stdout
    short = cli(
        "launch", "k8s", "--dry-run", "recipe=llama3_70b", "run_id=r", *K8S,
        "train.step_time_s=60", "launch.k8s.termination_grace_s=150",
        "resiliency.emergency_save_timeout_s=100",
    )  # fmt: skip
    assert short.returncode == 2
    assert "launch.k8s.termination_grace_s=159 or more" in short.stderr, short.stderr[-2000:]


def test_auto_on_a_cpu_run_needs_a_step_time() -> None:
    out = cli("pretrain", "recipe=gpt_tiny", "checkpoint.save_interval=auto", "run_id=r")
    assert out.returncode == 2
    assert "checkpoint.save_interval=auto needs the step time" in out.stderr
    assert "train.step_time_s" in out.stderr
    bad = cli("pretrain", "recipe=gpt_tiny", "checkpoint.save_interval=often", "--cfg", "job")
    assert bad.returncode == 2 and "give a number of steps (>= 1), auto" in bad.stderr


def test_the_two_planners_agree_and_the_suggested_command_runs() -> None:
    """--plan (the model built on the meta device) and `resiliency capacity` (the config's
    arithmetic) give the same bytes; the command --plan suggests runs as printed."""
    fit = cli("pretrain", "recipe=llama3_70b", "--plan", "--gpu", "H100")
    assert fit.returncode == 0, fit.stderr[-2000:]
    assert f"({PARAMS_70B * 14 / 1e9:.2f} GB) per version" in fit.stdout  # 987.81 GB
    assert "progress on Slurm (time limit 04:00:00, grace 300 s): ok" in fit.stdout
    suggested = re.search(r"save interval and storage: (.+)", fit.stdout)
    assert suggested, fit.stdout
    argv = shlex.split(suggested.group(1))
    assert argv[:3] == ["python", "-m", "resiliency"] and argv[3] == "capacity"
    capacity = cli(*argv[2:])
    assert capacity.returncode == 0, capacity.stdout + capacity.stderr
    assert f"total = {PARAMS_70B * 14 / 1e9:.2f} GB" in capacity.stdout
    # The old name still works.
    assert cli("resiliency", "plan", "--params", "70B").returncode == 0


@pytest.mark.parametrize("name", ["H100", "h100-80gb", "H200"])
def test_both_planners_and_the_config_take_the_same_gpu_names(name: str) -> None:
    assert cli("resiliency", "capacity", "--params", "7B", "--gpu", name).returncode == 0
    from pretrain.fit.memory import gpu_bytes
    from recipes import load_config

    assert load_config(["recipe=llama3_8b", f"launch.gpu={name}"]).launch.gpu == name
    assert gpu_bytes(name) >= 80 * 10**9


def test_an_unknown_gpu_is_refused_alike() -> None:
    capacity = cli("resiliency", "capacity", "--params", "7B", "--gpu", "B200")
    assert capacity.returncode == 2 and "h100-80gb" in capacity.stdout
    fit = cli("pretrain", "recipe=gpt_tiny", "--plan", "--gpu", "B200")
    assert fit.returncode == 2 and "h100-80gb" in fit.stderr
    config = cli("pretrain", "recipe=gpt_tiny", "launch.gpu=B200", "--cfg", "job")
    assert config.returncode == 2 and "h100-80gb" in config.stderr
