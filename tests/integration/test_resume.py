"""Exact resume: a run SIGKILLed on one rank resumes from its last commit with identical losses.

The baseline never saves; saving must not change the trajectory either, so every resumed
run is compared, step by step and bit for bit, with the same layout's uninterrupted run.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from pretrain.context import exit_codes
from resiliency.storage.layout import RunLayout
from tests.helpers import losses, read_steps, run_pretrain

pytestmark = pytest.mark.slow

STEPS, SAVE_EVERY = 8, 3
LAYOUTS = {
    "tp2": ["parallel.tp=2"],
    "pp2": ["parallel.tp=1", "parallel.pp=2"],
    "dp2": ["parallel.tp=1", "optimizer.use_distributed_optimizer=true"],
}
FORMATS = ["fully_reshardable", "dp_reshardable"]
MODES = {"sync": "checkpoint.async_save=false", "async": "checkpoint.async_save=true"}
CASES = list(itertools.product(LAYOUTS, FORMATS, MODES))
EVAL = ["train.eval_interval=2", "train.eval_iters=2"]
# The cases the second CI leg (megatron-core 0.19) also runs: both formats, sync and async.
CURRENT_STACK = {("tp2", "fully_reshardable", "async"), ("dp2", "dp_reshardable", "sync")}
# A pairwise cover of layout x format x mode: every pair of values meets in some case. The
# other six of the product are marked exhaustive (make test-all): a failure in those
# would need a three-way interaction.
PAIRWISE = {
    *CURRENT_STACK,
    ("tp2", "dp_reshardable", "sync"),
    ("dp2", "fully_reshardable", "async"),
    ("pp2", "fully_reshardable", "sync"),
    ("pp2", "dp_reshardable", "async"),
}


def _case_marks(case: tuple[str, str, str]) -> list[pytest.MarkDecorator]:
    marks = [pytest.mark.current_stack] if case in CURRENT_STACK else []
    return marks + ([] if case in PAIRWISE else [pytest.mark.exhaustive])


def _base(tiny: list[str], root: Path, run_id: str, layout: str) -> list[str]:
    return [
        *tiny,
        f"output_dir={root}",
        f"run_id={run_id}",
        f"train.train_steps={STEPS}",
        *LAYOUTS[layout],
    ]


@pytest.fixture(scope="module")
def baselines(tmp_path_factory: pytest.TempPathFactory, tiny_overrides: list[str]) -> dict:
    root = tmp_path_factory.mktemp("baseline")
    for layout in LAYOUTS:
        run_pretrain(2, [*_base(tiny_overrides, root, layout, layout), "checkpoint.enabled=false"])
    return {layout: losses(root / layout) for layout in LAYOUTS}


def kill_and_resume(
    tiny: list[str],
    root: Path,
    layout: str,
    extra: list[str],
    fault: str,
    env: dict[str, str] | None = None,
) -> Path:
    """Run until ``fault`` kills a rank, relaunch without it; returns the run dir."""
    base = [*_base(tiny, root, "run", layout), f"checkpoint.save_interval={SAVE_EVERY}", *extra]
    killed = run_pretrain(2, [*base, f"train.fault={fault}"], env=env, check=False)
    assert killed.returncode != 0, "the injected fault did not stop the run"
    run_pretrain(2, base, env=env)
    return root / "run"


@pytest.mark.parametrize(
    "layout, fmt, mode",
    [pytest.param(*c, id="-".join(c), marks=_case_marks(c)) for c in CASES],
)
def test_sigkill_resumes_bit_exact(
    baselines: dict, tiny_overrides: list[str], tmp_path: Path, layout: str, fmt: str, mode: str
) -> None:
    kill_step = 4 + CASES.index((layout, fmt, mode)) % 2  # between saves at 3 and 6
    run_dir = kill_and_resume(
        tiny_overrides,
        tmp_path,
        layout,
        # Validation on: the baseline runs without it, so this also shows eval moves nothing.
        [f"checkpoint.optim_format={fmt}", MODES[mode], *EVAL],
        f"kill@{kill_step}:1",
    )
    assert losses(run_dir) == baselines[layout]
    steps = read_steps(run_dir)
    assert sorted(steps) == list(range(1, STEPS + 1))
    assert RunLayout(tmp_path, "run").published_steps()[-1] == STEPS


@pytest.mark.current_stack
def test_resume_restores_step_lr_and_cursor(
    baselines: dict, tiny_overrides: list[str], tmp_path: Path
) -> None:
    run_dir = kill_and_resume(tiny_overrides, tmp_path, "tp2", [], "kill@5:0")
    steps = read_steps(run_dir)
    baseline_lr = [steps[s]["lr"] for s in sorted(steps)]
    assert len(baseline_lr) == STEPS
    attempts = sorted((run_dir / "attempts").glob("attempt-*.json"))
    assert len(attempts) == 2
    import json

    second = json.loads(attempts[1].read_text())
    assert second["restored_step"] == SAVE_EVERY and second["status"] == "finished"
    train_state = json.loads(
        (RunLayout(tmp_path, "run").step_dir(STEPS) / "train_state.json").read_text()
    )
    assert train_state["consumed_samples"] == STEPS * 8
    assert train_state["data_cursor"]["consumed_samples"] == STEPS * 8


@pytest.mark.parametrize("phase", ["save", "publish"])
def test_kill_during_save_falls_back(
    baselines: dict, tiny_overrides: list[str], tmp_path: Path, phase: str
) -> None:
    """A kill inside a save leaves no published step; the restart resumes from the one before."""
    rank = 1 if phase == "save" else 0
    base = [
        *_base(tiny_overrides, tmp_path, "run", "tp2"),
        f"checkpoint.save_interval={SAVE_EVERY}",
    ]
    killed = run_pretrain(2, [*base, f"train.fault=kill_{phase}@6:{rank}"], check=False)
    assert killed.returncode != 0
    layout = RunLayout(tmp_path, "run")
    assert layout.published_steps() == [3]
    leftovers = layout.tmp_dirs()
    assert [step for _, step, _ in leftovers] == [6]
    if phase == "publish":
        assert (leftovers[0][0] / "COMMITTED").exists(), "kill came after COMMITTED, before rename"
    run_pretrain(2, base)
    assert losses(tmp_path / "run") == baselines["tp2"]
    assert layout.tmp_dirs() == [], "the dead attempt's tmp dir is garbage-collected"


def test_second_writer_is_refused(tiny_overrides: list[str], tmp_path: Path) -> None:
    import subprocess
    import time

    from tests.helpers import REPO, pretrain_cmd

    base = [*_base(tiny_overrides, tmp_path, "run", "tp2"), "train.train_steps=400"]
    first = subprocess.Popen(
        pretrain_cmd(2, base),
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        lease = RunLayout(tmp_path, "run").lease_path
        deadline = time.time() + 120
        while not lease.exists() and time.time() < deadline:
            time.sleep(0.5)
        assert lease.exists(), "first job never took the lease"
        second = run_pretrain(2, base, check=False, timeout=120)
        assert second.returncode != 0
        assert "is held by" in second.stderr and "attempt 1" in second.stderr
        assert f"exit {exit_codes.LEASE_HELD}" in second.stderr
        assert first.poll() is None, "the refused job must not disturb the running one"
    finally:
        import os
        import signal

        os.killpg(first.pid, signal.SIGKILL)
        first.wait()


def test_uninitialised_weights_without_a_checkpoint_are_refused(
    tiny_overrides: list[str], tmp_path: Path
) -> None:
    base = [*_base(tiny_overrides, tmp_path, "run", "tp2"), "model.perform_initialization=false"]
    proc = run_pretrain(2, base, check=False, timeout=120)
    assert proc.returncode != 0
    assert f"(config, exit {exit_codes.CONFIG_ERROR}, do not retry)" in proc.stderr
    assert "model.perform_initialization=false leaves the weights uninitialised" in proc.stderr
    assert not RunLayout(tmp_path, "run").published_steps()
