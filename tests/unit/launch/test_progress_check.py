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

from pretrain.fit.timing import progress_problems, resolve_save_interval
from recipes import load_config

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


def slurm_dry_run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """A dry run of run ``r`` under ``tmp_path``, rendered into ``tmp_path/dry/r``."""
    dry = ["--dry-run", "--out", str(tmp_path / "dry")]
    return cli("launch", "slurm", *dry, f"output_dir={tmp_path}", "run_id=r", *args)


def pinned_interval(tmp_path: Path) -> int:
    """The interval the dry run pinned (where a submission pins it in the run dir)."""
    assert not (tmp_path / "r").exists()  # a dry run writes nothing into the run dir
    config = yaml.safe_load((tmp_path / "dry" / "r" / "launch-config.yaml").read_text())
    return config["checkpoint"]["save_interval"]


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
    no_fit = "--skip-fit-check"  # the interval is under test (the recipe fits: see above)
    out = slurm_dry_run(tmp_path, "recipe=llama3_70b", "train.step_time_s=60", no_fit)
    assert out.returncode == 0, out.stderr[-2000:]
    assert pinned_interval(tmp_path) == 117
    longer = slurm_dry_run(
        tmp_path / "long", "recipe=llama3_70b", "train.step_time_s=60",
        "launch.slurm.time_limit=2-00:00:00", no_fit,
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
    assert not (tmp_path / "r").exists() and not (tmp_path / "dry").exists()  # nothing
    anyway = slurm_dry_run(
        tmp_path, "--skip-progress-check", "recipe=llama3_70b", "checkpoint.save_interval=500",
        "--skip-fit-check",
    )  # fmt: skip
    assert anyway.returncode == 0, anyway.stderr[-2000:]
    assert pinned_interval(tmp_path) == 500  # a number is never replaced


def _resolved(*overrides: str) -> tuple[int, list[str]]:
    """The interval a Slurm launch pins for llama3_70b with ``overrides``, and why the job
    would not make progress (empty: it would), as `launch slurm` judges them (in-process)."""
    run = load_config(["recipe=llama3_70b", *overrides])
    slurm = run.launch.slurm
    resolved = resolve_save_interval(run, slurm.time_limit_s)
    problems = progress_problems(resolved, slurm.time_limit_s, slurm.signal_grace_s)
    return resolved.checkpoint.save_interval, problems


def test_a_time_limit_that_squeezes_auto_to_every_step_is_refused() -> None:
    """10 min at 80 s per step: a 300 s start leaves room for two intervals of (600 - 300) /
    160 = 1 step, and the 98.78 s async save outlasts that step. The smallest interval whose
    save fits in it is 2 steps, which needs 300 + 2 x 160 = 620 s = 10.3 min."""
    interval, [problem] = _resolved("train.step_time_s=80", "launch.slurm.time_limit=00:10:00")
    assert interval == 1
    assert "one save takes 99 s" in problem and "the 1 step(s) between two (80 s)" in problem
    assert "leaves room for a save every step only" in problem
    assert problem.endswith("give a time limit of at least 10.3 min"), problem
    # A cheap save does not rescue a squeezed interval: 200 s steps, 1 step between saves.
    interval, [problem] = _resolved("train.step_time_s=200", "launch.slurm.time_limit=00:10:00")
    assert interval == 1 and "takes longer" not in problem
    assert problem.endswith("at least 18.3 min"), problem  # 300 + 2 x (2 x 200) s
    # With room for two 2-step intervals, nothing to say.
    assert _resolved("train.step_time_s=80", "launch.slurm.time_limit=00:10:20") == (2, [])


def test_saves_longer_than_the_steps_between_them_are_refused() -> None:
    """An interval chosen by hand is judged alike: 1 x 60 s between two saves of 98.78 s."""
    interval, [problem] = _resolved("train.step_time_s=60", "checkpoint.save_interval=1")
    assert interval == 1 and problem.endswith("set checkpoint.save_interval>=2"), problem
    assert _resolved("train.step_time_s=60", "checkpoint.save_interval=2") == (2, [])


def test_a_toy_models_estimated_save_is_not_judged() -> None:
    """gpt_tiny on GPUs: an estimated 20 us step and 3 ms save, both far below the fixed costs
    the estimates leave out; a save every 10 steps is fine."""
    run = load_config(["recipe=gpt_tiny", "launch.gpus_per_node=2", "launch.nproc_per_node=2"])
    assert progress_problems(run, run.launch.slurm.time_limit_s, 300) == []


def test_a_squeezed_interval_is_refused_by_the_dry_run(tmp_path: Path) -> None:
    out = slurm_dry_run(tmp_path, "recipe=llama3_70b", "launch.slurm.time_limit=00:10:00")
    assert out.returncode == 2, out.stderr[-2000:]
    [error] = [ln for ln in out.stderr.splitlines() if "ERROR" in ln]
    assert "would not make progress: checkpoint.save_interval=1:" in error
    assert "--skip-progress-check" in error
    assert not (tmp_path / "r").exists() and not (tmp_path / "dry").exists()


# 490.7 GiB per GPU against 71.7 usable: 70B on one GPU per replica
TOO_BIG = ["recipe=llama3_70b", "parallel.tp=1", "parallel.pp=1",
           "parallel.sequence_parallel=false", "parallel.vpp=null"]  # fmt: skip


@pytest.mark.parametrize("launcher", ["slurm", "k8s"])
def test_a_layout_that_does_not_fit_is_refused_by_the_dry_run_too(
    launcher: str, tmp_path: Path
) -> None:
    pod = K8S[:-1] if launcher == "k8s" else []  # its output_dir: the one given here
    render_to = tmp_path / ("job.yaml" if launcher == "k8s" else "dry")  # --out
    where = ["--out", str(render_to), f"output_dir={tmp_path}", *pod]
    out = cli("launch", launcher, "--dry-run", *where, "run_id=r", *TOO_BIG)
    assert out.returncode == 2, out.stderr[-2000:]
    [error] = [ln for ln in out.stderr.splitlines() if "ERROR" in ln]
    assert "the layout does not fit h100-80gb: pipeline stage 0 needs" in error, error
    assert "--skip-fit-check" in error
    assert not any(tmp_path.iterdir())  # nothing rendered, the run dir not made
    anyway = cli("launch", launcher, "--dry-run", "--skip-fit-check", *where, "run_id=r", *TOO_BIG)
    assert anyway.returncode == 0, anyway.stderr[-2000:]


def test_a_pytorchjob_is_judged_by_its_termination_grace(tmp_path: Path) -> None:
    ok = cli(
        "launch", "k8s", "--dry-run", "--skip-fit-check", "recipe=llama3_70b", "run_id=r", *K8S
    )
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
