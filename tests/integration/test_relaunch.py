"""A relaunch never silently does something other than what the user asked (real runs).

Changed settings are diffed against the checkpoint's and refused or applied by rule; a launch
that names no run starts its own; a run whose every step fails verification stops instead of
starting over; the exit code a scheduler sees is the failing rank's; an unwritable output dir is
one config-error line.
"""

from __future__ import annotations

import errno
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pretrain.context import exit_codes
from pretrain.context.failures import classify
from recipes import ConfigError, load_config
from recipes.validate import resolve_run_id
from resiliency.storage.layout import RunLayout
from tests.ft_helpers import FT, env, launch_local
from tests.helpers import REPO, TORCHRUN, losses, read_steps, recommit_file, run_pretrain

SAVE_EVERY = 3


def _base(tiny: list[str], root: Path, steps: int, run_id: str = "run") -> list[str]:
    return [
        *tiny,
        f"output_dir={root}",
        f"run_id={run_id}",
        f"train.train_steps={steps}",
        f"checkpoint.save_interval={SAVE_EVERY}",
    ]


def _attempts(run_dir: Path) -> list[dict]:
    paths = sorted((run_dir / "attempts").glob("attempt-*.json"))
    return [json.loads(p.read_text()) for p in paths]


def _relaunch(overrides: list[str]) -> subprocess.CompletedProcess:
    """Through python -m launch.torchrun: the exit code is the failing rank's (README)."""
    return subprocess.run(
        [sys.executable, "-m", "launch.torchrun", "--standalone", "--nproc-per-node=2"]
        + ["-m", "pretrain", *overrides],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env=env(),
    )


@pytest.mark.slow
@pytest.mark.current_stack  # megatron's scheduler override flags on both releases
def test_changed_schedule_is_refused_kept_or_applied_only_when_asked(
    tiny_overrides: list[str], tmp_path: Path
) -> None:
    run_pretrain(2, _base(tiny_overrides, tmp_path, 6))
    run_dir, layout = tmp_path / "run", RunLayout(tmp_path, "run")
    config_before = (run_dir / "config.yaml").read_text()
    refused = _relaunch([*_base(tiny_overrides, tmp_path, 8), "optimizer.lr=1e-3"])
    assert refused.returncode == exit_codes.CONFIG_ERROR, refused.stderr[-3000:]
    assert "optimizer.lr: 0.003 -> 0.001" in refused.stderr
    assert "scheduler.decay_steps: 6 -> 8" in refused.stderr  # unset: follows train_steps
    assert "checkpoint.schedule_on_resume=" in refused.stderr
    assert "Traceback" not in refused.stderr
    # Said once (every rank refuses alike; rank 0 tells), with the failing rank's exit code.
    assert refused.stderr.count("optimizer.lr: 0.003 -> 0.001") == 1, refused.stderr[-3000:]
    assert (run_dir / "config.yaml").read_text() == config_before, "nothing is lost"
    assert layout.published_steps() == [3, 6]

    # Growing train_steps with the schedule pinned is free, and recorded; a changed lr kept from
    # the checkpoint when asked (schedule_on_resume=checkpoint) is recorded as kept.
    keep = [*_base(tiny_overrides, tmp_path, 8), "scheduler.decay_steps=6", "optimizer.lr=1e-3"]
    run_pretrain(2, [*keep, "checkpoint.schedule_on_resume=checkpoint"])
    changes = _attempts(run_dir)[-1]["config_changes"]
    assert changes["applied"]["train.train_steps"] == [6, 8]
    assert changes["kept_from_checkpoint"]["optimizer.lr"] == [0.003, 0.001]
    assert not {"scheduler.decay_steps"} & {*changes["applied"], *changes["kept_from_checkpoint"]}
    kept = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert kept["optimizer"]["lr"] == 0.003 and kept["scheduler"]["decay_steps"] == 6
    assert read_steps(run_dir)[7]["lr"] == pytest.approx(3e-4)  # the saved cosine's min_lr

    applied = [*_base(tiny_overrides, tmp_path, 10), "optimizer.lr=1e-3"]
    run_pretrain(2, [*applied, "checkpoint.schedule_on_resume=config"])
    record = _attempts(run_dir)[-1]
    assert record["restored_step"] == 8
    assert record["config_changes"]["applied"]["optimizer.lr"] == [0.003, 0.001]
    steps = read_steps(run_dir)
    # The pinned schedule had decayed to min_lr (3e-4) at step 6; the applied one is a cosine
    # from 1e-3 over steps 2..10 (warmup 2), as megatron's scheduler computes it.
    assert steps[8]["lr"] == pytest.approx(3e-4)
    expected = 3e-4 + 0.5 * (1 + math.cos(math.pi * (9 - 2) / (10 - 2))) * (1e-3 - 3e-4)
    assert steps[9]["lr"] == pytest.approx(expected, rel=1e-6)
    trained = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert trained["optimizer"]["lr"] == 1e-3


@pytest.mark.slow
def test_a_launch_without_run_id_starts_its_own_run_and_its_restarts_keep_it(
    tiny_overrides: list[str], tmp_path: Path
) -> None:
    """ft_launcher restarts the group in place after a kill: it resumes its own run. Launching
    the same command again (here with bare torchrun) starts a second run instead of continuing
    the first one."""
    overrides = [
        *tiny_overrides,
        f"output_dir={tmp_path}",
        "train.train_steps=6",
        "checkpoint.save_interval=2",
    ]
    first = launch_local([*overrides, *FT, "train.fault=kill@4:1/0"])
    assert first.returncode == 0, first.stderr[-4000:]
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert run_dir.name.startswith("gpt_tiny-")
    assert [a["restored_step"] for a in _attempts(run_dir)] == [None, 2]
    second = run_pretrain(2, overrides)
    assert "run_id not set: new run 'gpt_tiny-" in second.stderr
    (other,) = [p for p in tmp_path.iterdir() if p.is_dir() and p != run_dir]
    assert [a["restored_step"] for a in _attempts(other)] == [None]
    assert losses(other) == losses(run_dir)


def test_a_new_run_is_named_by_its_launch() -> None:
    run = load_config(["recipe=gpt_tiny"])
    uuid = "3f2a9c1b-0000-4000-8000-000000000000"
    named = resolve_run_id(run, uuid, world_size=2)
    assert named.run_id == "gpt_tiny-3f2a9c1b" == resolve_run_id(run, uuid, 2).run_id
    assert resolve_run_id(run, "job-42", 2).run_id == "gpt_tiny-job-42"
    assert resolve_run_id(run, None, 1).run_id.startswith("gpt_tiny-")
    with pytest.raises(ConfigError, match="set run_id"):
        resolve_run_id(run, "none", 2)  # torchrun's default --rdzv-id: not an id
    given = load_config(["recipe=gpt_tiny", "run_id=mine"])
    assert resolve_run_id(given, uuid, 2).run_id == "mine"


@pytest.mark.slow
def test_no_step_to_trust_stops_the_run_until_told_to_start_over(
    tiny_overrides: list[str], tmp_path: Path
) -> None:
    base = _base(tiny_overrides, tmp_path, 6)
    run_pretrain(2, base)
    layout = RunLayout(tmp_path, "run")
    original = losses(tmp_path / "run")
    # Step 6: a directory symlink leading out of the run. Step 3: train_state.json moved to
    # another step, manifest and marker recomputed so that only the content disagrees.
    outside = tmp_path / "outside"
    outside.mkdir()
    (layout.step_dir(6) / "rank-state" / "extra").symlink_to(outside, target_is_directory=True)
    state = layout.step_dir(3) / "train_state.json"
    state.write_text(json.dumps({**json.loads(state.read_text()), "step": 2}))
    recommit_file(layout.step_dir(3), "train_state.json")
    for step in (3, 6):
        verify = subprocess.run(
            [sys.executable, "-m", "resiliency", "verify", str(layout.step_dir(step))],
            cwd=REPO,
            capture_output=True,
            text=True,
        )
        assert verify.returncode == 1, verify.stdout
    refused = _relaunch(base)
    assert refused.returncode == exit_codes.CHECKPOINT_IO, refused.stderr[-3000:]
    assert "holds 2 published step(s) and none verifies" in refused.stderr
    assert "'rank-state/extra' is a symlink" in refused.stderr
    assert "train_state.json says step 2" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert layout.published_steps() == [3, 6] and layout.tmp_dirs() == []
    run_pretrain(2, [*base, "checkpoint.start_over_if_unverified=true"])
    assert losses(tmp_path / "run") == original  # the same seed, trained again from step 1


@pytest.mark.slow
def test_the_scheduler_sees_the_failing_rank_exit_code(
    tiny_overrides: list[str], tmp_path: Path
) -> None:
    """Bare torchrun reports 1 for any worker failure; python -m launch.torchrun reports the code
    the README documents (here 2: the global batch does not divide)."""
    args = [
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "pretrain",
        *tiny_overrides,
        f"output_dir={tmp_path}",
        "run_id=bad",
        "train.global_batch_size=7",
    ]
    run_env = env()
    bare = subprocess.run([TORCHRUN, *args], cwd=REPO, capture_output=True, text=True, env=run_env)
    assert bare.returncode == 1
    wrapped = subprocess.run(
        [sys.executable, "-m", "launch.torchrun", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=run_env,
    )
    assert wrapped.returncode == exit_codes.CONFIG_ERROR, wrapped.stderr[-3000:]
    assert "global_batch_size=7 must be a multiple" in wrapped.stderr


@pytest.mark.slow
def test_an_unwritable_output_dir_is_one_config_error_line(
    tiny_overrides: list[str], tmp_path: Path
) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the output dir should be")
    proc = _relaunch([*tiny_overrides, f"output_dir={blocker}", "run_id=x"])
    assert proc.returncode == exit_codes.CONFIG_ERROR, proc.stderr[-3000:]
    # Refused before any rank starts (recipes.inputs), in one line.
    assert "exists and is not a directory" in proc.stderr and "Traceback" not in proc.stderr


def test_local_storage_refusals_are_not_retried() -> None:
    for code in (errno.EROFS, errno.EACCES, errno.ENOSPC):
        failure = classify(OSError(code, "refused"))
        assert (failure.kind, failure.exit_code, failure.retryable) == (
            "checkpoint",
            exit_codes.CHECKPOINT_IO,
            False,
        )
