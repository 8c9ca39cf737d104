"""Cross-parallelism restore: allowed changes reshard exactly, the rest is refused up front.

Each original run saves at step 4 and 5. A copy without step 5 is resumed under a new layout,
which recomputes step 5 from the restored step-4 state; its loss and its step-5 checkpoint
(weights and Adam moments, gathered layout-free) must match the original's. A wrong or
missing moment would show up in that update.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from pretrain.context import exit_codes
from resiliency.storage.layout import RunLayout
from tests.helpers import REPO, losses, run_pretrain

pytestmark = pytest.mark.slow
SAVE_STEP, STEPS = 4, 5
LAYOUTS = {
    "tp2": (2, ["parallel.tp=2"]),
    "pp2": (2, ["parallel.tp=1", "parallel.pp=2"]),
    # fully_reshardable saves are refused here (compat K); loading them is fine.
    "pp2vpp2": (
        2,
        [
            "parallel.tp=1",
            "parallel.pp=2",
            "parallel.vpp=2",
            "checkpoint.optim_format=dp_reshardable",
        ],
    ),
    "dp2": (2, ["parallel.tp=1"]),
    "world1": (1, ["parallel.tp=1"]),
}
RESHARDS = [
    ("tp2", "dp2"),
    ("tp2", "pp2"),
    ("tp2", "pp2vpp2"),
    ("tp2", "world1"),
    ("pp2", "tp2"),
    ("dp2", "tp2"),
]
TOLERANCE = 2e-5


def _run(tiny: list[str], root: Path, layout: str, extra: list[str], check: bool = True):
    nproc, overrides = LAYOUTS[layout]
    return run_pretrain(
        nproc,
        [
            *tiny,
            f"output_dir={root}",
            "run_id=run",
            f"train.train_steps={STEPS}",
            f"checkpoint.save_interval={SAVE_STEP}",
            *overrides,
            *extra,
        ],
        check=check,
    )


@pytest.fixture(scope="module")
def originals(tmp_path_factory: pytest.TempPathFactory, tiny_overrides: list[str]) -> dict:
    roots = {}
    for name, layout, extra in [
        ("tp2", "tp2", []),
        ("pp2", "pp2", []),
        ("dp2", "dp2", []),
        ("dp2-dp_resh", "dp2", ["checkpoint.optim_format=dp_reshardable"]),
    ]:
        root = tmp_path_factory.mktemp(name)
        _run(tiny_overrides, root, layout, extra)
        roots[name] = root
    return roots


def _resume_copy(original: Path, tmp_path: Path) -> Path:
    """A copy of the run as it was right after step 4 was published."""
    root = tmp_path / "copy"
    shutil.copytree(original, root)
    layout = RunLayout(root, "run")
    shutil.rmtree(layout.step_dir(STEPS))
    layout.latest_path.unlink()
    return root


def _full_state(root: Path, step: int, tmp_path: Path) -> dict[str, torch.Tensor]:
    out = tmp_path / f"state-{root.name}-{step}.pt"
    dcp_to_torch_save(RunLayout(root, "run").step_dir(step) / "model", out)
    state = torch.load(out, weights_only=False)
    return {k: v for k, v in state.items() if torch.is_tensor(v) and "_extra_state" not in k}


def _assert_states_close(a: dict, b: dict) -> None:
    if not any(".exp_avg_sq." in k for k in a):  # dp_reshardable state is layout-bound
        a, b = ({k: v for k, v in d.items() if not k.startswith("optimizer.")} for d in (a, b))
    assert a.keys() == b.keys()
    worst = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    assert worst < TOLERANCE, worst


def _validate_cli(run_dir: Path, nproc: int, overrides: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "resiliency",
            "validate",
            str(run_dir),
            *overrides,
            f"--world-size={nproc}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


# Also on megatron-core 0.19: a TP->PP and a TP->VPP reshard (PP->TP is the same code path).
CURRENT_STACK = {("tp2", "pp2"), ("tp2", "pp2vpp2")}


@pytest.mark.parametrize(
    "source, target",
    [
        pytest.param(
            s, t, id=f"{s}-to-{t}", marks=[pytest.mark.current_stack] * ((s, t) in CURRENT_STACK)
        )
        for s, t in RESHARDS
    ],
)
def test_fully_reshardable_restores_exactly(
    originals: dict, tiny_overrides: list[str], tmp_path: Path, source: str, target: str
) -> None:
    root = _resume_copy(originals[source], tmp_path)
    nproc, overrides = LAYOUTS[target]
    report = _validate_cli(root / "run", nproc, [*tiny_overrides, *overrides])
    assert report.returncode == 0 and "verdict: OK" in report.stdout, report.stdout
    assert "reshardable" in report.stdout
    proc = _run(tiny_overrides, root, target, [])
    assert f"resumed from step-{SAVE_STEP:09d}" in proc.stderr
    assert "RNG reseeded" in proc.stderr
    assert losses(root / "run")[-1] == pytest.approx(
        losses(originals[source] / "run")[-1], abs=TOLERANCE
    )
    _assert_states_close(
        _full_state(root, STEPS, tmp_path), _full_state(originals[source], STEPS, tmp_path)
    )


@pytest.mark.current_stack
def test_dp_reshardable_restores_across_dp(
    originals: dict, tiny_overrides: list[str], tmp_path: Path
) -> None:
    root = _resume_copy(originals["dp2-dp_resh"], tmp_path)
    _run(tiny_overrides, root, "world1", ["checkpoint.optim_format=dp_reshardable"])
    assert losses(root / "run")[-1] == pytest.approx(
        losses(originals["dp2-dp_resh"] / "run")[-1], abs=TOLERANCE
    )


@pytest.mark.parametrize("target", ["tp2", "pp2"])
def test_dp_reshardable_refuses_model_parallel_change(
    originals: dict, tiny_overrides: list[str], tmp_path: Path, target: str
) -> None:
    root = _resume_copy(originals["dp2-dp_resh"], tmp_path)
    nproc, overrides = LAYOUTS[target]
    report = _validate_cli(root / "run", nproc, [*tiny_overrides, *overrides])
    assert report.returncode == exit_codes.TOPOLOGY_REFUSED, report.stdout
    assert "dp_reshardable optimizer state reshards across dp only" in report.stdout
    assert "fully_reshardable" in report.stdout and "load_optimizer=false" in report.stdout
    proc = _run(tiny_overrides, root, target, [], check=False)
    assert proc.returncode != 0
    assert f"(topology, exit {exit_codes.TOPOLOGY_REFUSED}, do not retry)" in proc.stderr
    assert "cannot be restored into this layout" in proc.stderr
    assert "CheckpointingException" not in proc.stderr and "Global shape" not in proc.stderr


def test_weights_only_restore_is_allowed_and_warned(
    originals: dict, tiny_overrides: list[str], tmp_path: Path
) -> None:
    root = _resume_copy(originals["dp2-dp_resh"], tmp_path)
    proc = _run(tiny_overrides, root, "tp2", ["checkpoint.load_optimizer=false"])
    assert "FRESH optimizer state" in proc.stderr
    assert f"resumed from step-{SAVE_STEP:09d}" in proc.stderr
    # Step 5's loss is the forward pass of the restored step-4 weights (built uninitialised,
    # perform_initialization=false): only the optimizer is fresh.
    assert losses(root / "run")[-1] == pytest.approx(
        losses(originals["dp2-dp_resh"] / "run")[-1], abs=TOLERANCE
    )


def test_moe_expert_parallel_change_is_refused(tiny_overrides: list[str], tmp_path: Path) -> None:
    moe = ["recipe=gpt_tiny_moe"]
    run_pretrain(
        2,
        [
            *tiny_overrides,
            *moe,
            f"output_dir={tmp_path}",
            "run_id=run",
            "train.train_steps=2",
            "parallel.ep=2",
        ],
    )
    proc = run_pretrain(
        2,
        [
            *tiny_overrides,
            *moe,
            f"output_dir={tmp_path}",
            "run_id=run",
            "train.train_steps=3",
            "parallel.ep=1",
        ],
        check=False,
    )
    assert f"(topology, exit {exit_codes.TOPOLOGY_REFUSED}" in proc.stderr
    assert "cannot reshard MoE optimizer state across EP" in proc.stderr


def test_model_shape_change_is_refused(originals: dict) -> None:
    report = _validate_cli(originals["tp2"] / "run", 2, ["model.num_layers=8"])
    assert report.returncode == exit_codes.TOPOLOGY_REFUSED
    assert (
        "model shape changed" in report.stdout and "a new model needs a new run_id" in report.stdout
    )


def test_batch_size_change_needs_an_lr_rule(
    originals: dict, tiny_overrides: list[str], tmp_path: Path
) -> None:
    report = _validate_cli(originals["tp2"] / "run", 2, ["train.global_batch_size=16"])
    assert report.returncode == exit_codes.TOPOLOGY_REFUSED
    assert "batch_change_lr_scaling" in report.stdout
    root = _resume_copy(originals["tp2"], tmp_path)
    proc = _run(
        tiny_overrides,
        root,
        "tp2",
        ["train.global_batch_size=16", "checkpoint.batch_change_lr_scaling=linear"],
    )
    assert "global batch 8 -> 16: lr scaled by rule 'linear'" in proc.stderr
