"""The command lines as a Hydra / Megatron user types them: real processes, exit codes, output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pretrain.context import exit_codes
from recipes import list_recipes
from recipes.describe import describe_keys
from tests.helpers import REPO, read_steps


def _cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120):  # noqa: ANN202
    return subprocess.run(
        [sys.executable, "-m", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
    )


def _one_line_error(proc: subprocess.CompletedProcess, code: int) -> str:
    assert proc.returncode == code, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr
    [line] = [ln for ln in proc.stderr.splitlines() if "ERROR" in ln]
    return line


# ------------------------------------------------------------------ Hydra conventions


def test_cfg_job_prints_the_composed_config_and_resolve_resolves_it() -> None:
    args = ("pretrain", "recipe=gpt_tiny", "train.eval_interval=${train.train_steps}")
    raw = _cli(*args, "--cfg", "job")
    assert raw.returncode == 0, raw.stderr
    tree = yaml.safe_load(raw.stdout)
    assert tree["model"]["name"] == "gpt_tiny" and "hydra" not in tree
    assert tree["train"]["eval_interval"] == "${train.train_steps}"
    resolved = yaml.safe_load(_cli(*args, "--cfg", "job", "--resolve").stdout)
    assert resolved["train"]["eval_interval"] == resolved["train"]["train_steps"] == 30


def test_cfg_hydra_and_info() -> None:
    hydra = _cli("pretrain", "recipe=gpt_tiny", "--cfg", "hydra")
    assert hydra.returncode == 0 and "runtime:" in hydra.stdout, hydra.stderr
    info = _cli("pretrain", "recipe=gpt_tiny", "data=mock", "--info")
    assert info.returncode == 0, info.stderr
    assert "  data: mock\n" in info.stdout and "  recipe: gpt_tiny\n" in info.stdout


def test_deletion_and_hydra_keys() -> None:
    proc = _cli(
        "pretrain",
        "recipe=gpt_tiny",
        "train.fault=kill@3",
        "~train.fault",
        "~train.eval_interval",
        "hydra.run.dir=out/x",
        "--cfg",
        "job",
    )
    assert proc.returncode == 0, proc.stderr
    tree = yaml.safe_load(proc.stdout)
    assert (tree["train"]["fault"], tree["train"]["eval_interval"]) == ("", None)
    assert tree["output_dir"] == "out/x"
    line = _one_line_error(_cli("pretrain", "recipe=gpt_tiny", "~train.train_steps"), 2)
    assert "~train.train_steps: a int key cannot be deleted" in line
    line = _one_line_error(_cli("pretrain", "recipe=gpt_tiny", "hydra.job.chdir=true"), 2)
    assert "'hydra.job.chdir=true'" in line and "hydra.run.dir (= output_dir)" in line
    line = _one_line_error(_cli("pretrain", "recipe=gpt_tiny", "--cfgg", "job"), 2)
    assert "unknown option '--cfgg'" in line


def test_type_errors_name_the_key_and_type() -> None:
    line = _one_line_error(_cli("pretrain", "recipe=gpt_tiny", "train.train_steps=abc"), 2)
    assert "train.train_steps=abc: expected int, got 'abc'" in line


@pytest.mark.slow
def test_multirun_runs_every_point_as_its_own_run(stdlib_corpus: str, tmp_path: Path) -> None:
    proc = _cli(
        "pretrain",
        "-m",
        "recipe=gpt_tiny",
        f"data.paths=[{stdlib_corpus}]",
        "parallel.tp=1",
        "train.train_steps=2",
        "checkpoint.save_interval=null",
        f"output_dir={tmp_path}",
        "run_id=sweep",
        "optimizer.lr=1e-3,5e-3",
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "sweep point 2/2: " in proc.stderr
    first, second = read_steps(tmp_path / "sweep-0"), read_steps(tmp_path / "sweep-1")
    assert sorted(first) == sorted(second) == [1, 2]
    assert first[1]["lr"] != second[1]["lr"]
    pinned = [
        yaml.safe_load((tmp_path / r / "config.yaml").read_text()) for r in ("sweep-0", "sweep-1")
    ]
    assert [c["optimizer"]["lr"] for c in pinned] == [1e-3, 5e-3]


def test_multirun_under_torchrun_is_refused() -> None:
    proc = _cli("pretrain", "-m", "recipe=gpt_tiny", "train.seed=1,2", env={"WORLD_SIZE": "2"})
    assert "python -m launch local -m" in _one_line_error(proc, 2)


def test_slurm_sweep_renders_one_job_per_point(stdlib_corpus: str, tmp_path: Path) -> None:
    """Each point's dry run renders into --out DIR/<its run id>, none into a run dir."""
    proc = _cli(
        "launch",
        "slurm",
        "--dry-run",
        "--out",
        str(tmp_path / "dry"),
        "-m",
        "recipe=gpt_tiny",
        f"data.paths=[{stdlib_corpus}]",
        f"output_dir={tmp_path}",
        "run_id=grid",
        "launch.nodes=2",
        "train.seed=1,2,3",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    scripts = sorted(p.name for p in tmp_path.glob("dry/grid-*/slurm/*.sbatch"))
    assert scripts == ["grid-0.sbatch", "grid-1.sbatch", "grid-2.sbatch"]
    seeds = [
        yaml.safe_load((tmp_path / "dry" / f"grid-{i}" / "launch-config.yaml").read_text())
        for i in range(3)
    ]
    assert [config["train"]["seed"] for config in seeds] == [1, 2, 3]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dry"]  # no run dir made


# ------------------------------------------------------------------ discoverable


def test_help_lists_recipes_and_groups() -> None:
    proc = _cli("pretrain", "--help")
    assert proc.returncode == 0
    for name in list_recipes():
        assert f"\n  {name} " in proc.stdout, name
    assert "config groups" in proc.stdout and "    stdlib " in proc.stdout
    for flag in ("--cfg", "--info", "--multirun", "--show-keys"):
        assert flag in proc.stdout


def test_show_keys_has_type_default_and_description() -> None:
    proc = _cli("pretrain", "--show-keys")
    assert proc.returncode == 0
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("train.train_steps "))
    assert " int " in line and "= 20" in line and "# optimizer steps of the run" in line
    assert len(proc.stdout.splitlines()) == len(describe_keys())


def test_every_key_has_a_description() -> None:
    missing = [k.key for k in describe_keys() if not k.help]
    assert not missing, f"add a comment to these schema fields: {missing}"


def test_every_recipe_and_option_has_a_summary() -> None:
    proc = _cli("pretrain", "--help")
    rows = [ln for ln in proc.stdout.splitlines() if ln.startswith("  ") and ":" not in ln[-1:]]
    assert all(len(r.split(None, 1)) == 2 for r in rows), rows


def test_launch_help_lists_backends_actions_and_overrides() -> None:
    top = _cli("launch", "--help").stdout
    assert all(b in top for b in ("local", "slurm", "k8s")) and "Hydra override" in top
    k8s = _cli("launch", "k8s", "--help").stdout
    assert all(f"k8s {a} NAME" in k8s for a in ("status", "logs", "delete"))
    assert "Hydra override" in _cli("launch", "slurm", "--help").stdout


# ------------------------------------------------------------------ fail fast on inputs


def test_missing_data_prefix_names_the_nearest_dataset(stdlib_corpus: str, tmp_path: Path) -> None:
    typo = str(Path(stdlib_corpus).parent / "stdlib")
    for args in (("pretrain",), ("launch", "slurm"), ("launch", "local")):
        proc = _cli(*args, "recipe=gpt_tiny", f"data.paths=[{typo}]")
        line = _one_line_error(proc, exit_codes.DATA)
        assert f"did you mean '{stdlib_corpus}'?" in line, (args, line)
    # A dry run renders for a cluster whose file systems may not be mounted here: it says so.
    rendered = _cli("launch", "slurm", "--dry-run", "recipe=gpt_tiny", f"data.paths=[{typo}]",
                    "output_dir=/tmp/mcore-dry-run-check",
                    env={"TMPDIR": str(tmp_path)})  # fmt: skip
    assert rendered.returncode == 0, rendered.stderr[-2000:]
    assert f"dry run, rendered anyway: data.paths: '{typo}'" in rendered.stderr
    assert f"did you mean '{stdlib_corpus}'?" in rendered.stderr


def test_missing_tokenizer_and_unwritable_output(stdlib_corpus: str, tmp_path: Path) -> None:
    base = ("pretrain", "recipe=gpt_tiny", f"data.paths=[{stdlib_corpus}]")
    proc = _cli(*base, "data.tokenizer=huggingface", f"data.tokenizer_path={tmp_path}/tok")
    assert f"data.tokenizer_path={tmp_path}/tok: not found" in _one_line_error(
        proc, exit_codes.DATA
    )
    proc = _cli(*base, "output_dir=/proc/mcore-runs")  # not writable, even for root
    assert "output_dir=/proc/mcore-runs: cannot write in /proc" in _one_line_error(proc, 2)
    marker = json.dumps({"ok": True})
    (tmp_path / "file").write_text(marker)
    proc = _cli(*base, f"output_dir={tmp_path}/file/runs")
    assert "exists and is not a directory" in _one_line_error(proc, 2)
