"""A checkpoint saved with one supported stack restores with the other where megatron-core allows.

The two stacks are the two venvs `make install` builds: `.venv` (Python 3.11, megatron-core
0.16.1) and `.venv312` (Python 3.12, megatron-core 0.19.x). 0.16 -> 0.19 restores weights and
Adam moments exactly; 0.19 -> 0.16 is refused up front with the reason. The end-to-end tests
need both venvs and skip, naming the missing one, where it does not exist (`.ci/run` builds both).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from pretrain.context import exit_codes
from resiliency.checkpoint.restore.topology import MCORE, Target, validate
from resiliency.storage.layout import RunLayout
from resiliency.storage.manifest import Manifest
from tests.helpers import REPO, losses

pytestmark = pytest.mark.current_stack
STACKS = {"0.16": REPO / ".venv", "0.19": REPO / ".venv312"}
BUILD = {"0.16": "make install", "0.19": "make install PY=3.12"}
SAVE_STEP, STEPS = 4, 5
LAYOUTS = {"tp2": ["parallel.tp=2"], "pp2": ["parallel.tp=1", "parallel.pp=2"]}
TOLERANCE = 2e-5  # a layout change reorders reductions; the same layout must match bit for bit


# ---- the validator's rule (no venv needed) ----


def _manifest(mcore: str | None, fmt: str = "fully_reshardable", tp: int = 2) -> Manifest:
    versions = {MCORE: mcore} if mcore else {}
    return Manifest(
        run_id="run",
        attempt=1,
        step=4,
        world_size=2,
        parallelism={"tp": tp, "pp": 1, "dp": 2 // tp},
        optim_format=fmt,
        versions=versions,
        config={"train": {"global_batch_size": 8}},
    )


def _target(mcore: str, tp: int = 2, load_optimizer: bool = True) -> Target:
    return Target(
        parallelism={"tp": tp, "pp": 1, "dp": 2 // tp},
        world_size=2,
        model={},
        vocab_size=0,
        padded_vocab_size=None,
        global_batch_size=8,
        load_optimizer=load_optimizer,
        batch_change_lr_scaling="refuse",
        mcore_version=mcore,
    )


def _row(manifest: Manifest, target: Target):
    report = validate(manifest, target)
    return report, next(r for r in report.rows if r.name == MCORE)


@pytest.mark.parametrize(
    "saved, restoring, verdict, reason",
    [
        ("0.16.1", "0.16.1", "same", ""),
        ("0.19.0", "0.19.2", "same", ""),
        ("0.16.1", "0.19.2", "reshardable", "weights and Adam moments restore exactly"),
        ("0.19.2", "0.16.1", "refused", "no model/common.pt"),
        ("0.15.3", "0.19.2", "refused", "0.15 checkpoint with 0.19 is not measured"),
        (None, "0.19.2", "reshardable", "not recorded"),
    ],
)
def test_version_verdicts(saved: str | None, restoring: str, verdict: str, reason: str) -> None:
    report, row = _row(_manifest(saved), _target(restoring))
    assert (row.verdict, row.saved, row.target) == (verdict, saved, restoring)
    assert reason in row.reason
    if verdict == "refused":
        assert report.refused and f"megatron-core that saved it ({saved})" in report.table()


def test_dp_reshardable_crosses_versions_on_the_same_layout_only() -> None:
    same = _row(_manifest("0.16.1", "dp_reshardable"), _target("0.19.2"))[1]
    assert same.verdict == "reshardable"
    moved = _row(_manifest("0.16.1", "dp_reshardable"), _target("0.19.2", tp=1))[1]
    assert moved.verdict == "refused" and "same layout only" in moved.reason
    weights_only = _row(
        _manifest("0.16.1", "dp_reshardable"), _target("0.19.2", tp=1, load_optimizer=False)
    )[1]
    assert weights_only.verdict == "reshardable"


# ---- end to end: save with one venv, restore with the other ----


def _stack(series: str) -> Path:
    venv = STACKS[series]
    if not (venv / "bin" / "torchrun").exists():
        pytest.skip(
            f"the megatron-core {series} stack is not installed: no {venv.name} "
            f"(build it with `{BUILD[series]}`)"
        )
    return venv


def _pretrain(
    venv: Path, corpus: str, root: Path, layout: str, check: bool = True, steps: int = STEPS
) -> subprocess.CompletedProcess:
    cmd = [
        str(venv / "bin" / "torchrun"),
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "pretrain",
        "recipe=gpt_tiny",
        f"data.paths=[{corpus}]",
        f"output_dir={root}",
        "run_id=run",
        f"train.train_steps={steps}",
        f"checkpoint.save_interval={SAVE_STEP}",
        *LAYOUTS[layout],
    ]
    proc = subprocess.run(
        cmd,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**_env(), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"},
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{venv.name} pretrain failed ({proc.returncode}):\n{proc.stderr[-6000:]}"
        )
    return proc


def _env() -> dict[str, str]:
    import os

    # The other venv's interpreter must not see this one's site-packages.
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}


def _resume_copy(original: Path, tmp_path: Path, name: str) -> Path:
    root = tmp_path / name
    shutil.copytree(original, root)
    layout = RunLayout(root, "run")
    shutil.rmtree(layout.step_dir(STEPS))
    layout.latest_path.unlink()
    return root


def _state(root: Path, tmp_path: Path) -> dict[str, torch.Tensor]:
    out = tmp_path / f"state-{root.name}.pt"
    dcp_to_torch_save(RunLayout(root, "run").step_dir(STEPS) / "model", out)
    state = torch.load(out, weights_only=False)
    return {k: v for k, v in state.items() if torch.is_tensor(v) and "_extra_state" not in k}


@pytest.fixture(scope="module")
def saved_by_016(tmp_path_factory: pytest.TempPathFactory, stdlib_corpus: str) -> Path:
    old = _stack("0.16")
    _stack("0.19")
    root = tmp_path_factory.mktemp("saved-0.16")
    _pretrain(old, stdlib_corpus, root, "tp2")
    return root


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_016_checkpoint_restores_on_019(
    saved_by_016: Path, stdlib_corpus: str, tmp_path: Path, layout: str
) -> None:
    """Step 4 saved by 0.16 (fully_reshardable), step 5 recomputed by 0.19: same loss, weights
    and Adam moments as 0.16's own step 5 (bit-exact on the same layout)."""
    root = _resume_copy(saved_by_016, tmp_path, f"on-0.19-{layout}")
    validate_cli = subprocess.run(
        [
            str(STACKS["0.19"] / "bin" / "python"),
            "-m",
            "resiliency",
            "validate",
            str(root / "run"),
            *LAYOUTS[layout],
            "--world-size=2",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
    )
    assert validate_cli.returncode == 0, validate_cli.stdout + validate_cli.stderr
    assert "0.16 -> 0.19 measured" in validate_cli.stdout
    proc = _pretrain(STACKS["0.19"], stdlib_corpus, root, layout)
    assert f"resumed from step-{SAVE_STEP:09d}" in proc.stderr
    original, resumed = _state(saved_by_016, tmp_path), _state(root, tmp_path)
    assert original.keys() == resumed.keys()
    assert any(".exp_avg_sq." in k for k in original), "no Adam moments in the checkpoint"
    if layout == "tp2":
        assert losses(root / "run") == losses(saved_by_016 / "run")
        differ = [k for k in original if not torch.equal(original[k], resumed[k])]
        assert not differ, f"0.16 -> 0.19 restore changed {differ[:5]}"
    else:
        worst = max((original[k].float() - resumed[k].float()).abs().max().item() for k in original)
        assert worst < TOLERANCE, worst


@pytest.mark.slow
def test_019_checkpoint_is_refused_by_016(stdlib_corpus: str, tmp_path: Path) -> None:
    """Refused before anything is loaded, with the reason and what to do instead."""
    new, old = _stack("0.19"), _stack("0.16")
    root = tmp_path / "saved-0.19"
    _pretrain(new, stdlib_corpus, root, "tp2", steps=SAVE_STEP)
    validate_cli = subprocess.run(
        [
            str(old / "bin" / "python"),
            "-m",
            "resiliency",
            "validate",
            str(root / "run"),
            "--world-size=2",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
    )
    assert validate_cli.returncode == exit_codes.TOPOLOGY_REFUSED, validate_cli.stdout
    assert "megatron-core 0.19 writes the common state" in validate_cli.stdout
    proc = _pretrain(old, stdlib_corpus, root, "tp2", check=False)
    assert proc.returncode != 0
    assert f"(topology, exit {exit_codes.TOPOLOGY_REFUSED}, do not retry)" in proc.stderr
    assert "megatron-core 0.19 writes the common state inside the torch_dist shards" in proc.stderr
    assert "restore with the megatron-core that saved it (0.19." in proc.stderr
