"""Real multi-process gloo training on the stdlib corpus, for every parallel layout.

Each layout runs once (module-scoped), validating every 5 steps; the loss must fall, and the
first steps and every validation loss must equal the single-rank TP=1 run: with
layout-invariant init and a fixed padded vocab, any wiring error in TP/PP/VPP/DP/EP shows up as
a loss difference. The TP=1 run once more without validation gives the same losses bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import losses, run_pretrain

pytestmark = [pytest.mark.slow, pytest.mark.current_stack]

LAYOUTS = {
    "tp2": ["parallel.tp=2"],
    "pp2": ["parallel.tp=1", "parallel.pp=2"],
    "pp2_vpp2": ["parallel.tp=1", "parallel.pp=2", "parallel.vpp=2"],
    "dp2_distopt": ["parallel.tp=1", "optimizer.use_distributed_optimizer=true"],
}
EQUIVALENT_STEPS = 6
TOLERANCE = 2e-5
EVAL = ["train.eval_interval=5", "train.eval_iters=2"]


def eval_losses(run_dir: Path) -> list[tuple[str, int, float]]:
    lines = (run_dir / "metrics" / "eval.jsonl").read_text().splitlines()
    return [(r["split"], r["step"], r["loss"]) for r in map(json.loads, lines)]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, tiny_overrides: list[str]) -> dict:
    root = tmp_path_factory.mktemp("train")
    results = {}
    base = [*tiny_overrides, f"output_dir={root}", "checkpoint.enabled=false"]
    run_pretrain(1, [*base, "run_id=tp1", "parallel.tp=1", *EVAL])
    run_pretrain(1, [*base, "run_id=tp1-no-eval", "parallel.tp=1"])
    for name, overrides in LAYOUTS.items():
        run_pretrain(2, [*base, f"run_id={name}", *overrides, *EVAL])
    results["attempts"] = sorted((root / "tp1" / "attempts").glob("attempt-*.json"))
    for name in ["tp1", "tp1-no-eval", *LAYOUTS]:
        results[name] = losses(root / name)
        if name != "tp1-no-eval":
            results[f"{name}-eval"] = eval_losses(root / name)
    return results


def test_a_run_without_checkpoints_still_records_its_attempt(trained: dict) -> None:
    """checkpoint.enabled=false: the attempt record is the run context's, not the checkpoint
    hook's, so it is there, finished at the last step."""
    (path,) = trained["attempts"]
    record = json.loads(path.read_text())
    assert (record["status"], record["step"], record["exit_code"]) == ("finished", 10, 0)
    assert [r["rank"] for r in record["ranks"]] == [0]


def test_validation_moves_no_training_state(trained: dict) -> None:
    assert trained["tp1"] == trained["tp1-no-eval"]  # bit for bit: no data cursor, no RNG
    splits = [(split, step) for split, step, _ in trained["tp1-eval"]]
    assert splits == [("valid", 5), ("valid", 10)]  # the last step validated: no repeat


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_validation_matches_single_rank(trained: dict, layout: str) -> None:
    reference = [loss for _, _, loss in trained["tp1-eval"]]
    ours = [loss for _, _, loss in trained[f"{layout}-eval"]]
    assert ours[:1] == pytest.approx(reference[:1], abs=TOLERANCE), (layout, ours, reference)
    assert len(ours) == len(reference) and all(4.0 < loss < 6.5 for loss in ours)


@pytest.mark.parametrize("layout", ["tp1", *LAYOUTS])
def test_loss_goes_down(trained: dict, layout: str) -> None:
    curve = trained[layout]
    assert len(curve) == 10
    assert curve[-1] < curve[0] - 0.5, curve


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_rank(trained: dict, layout: str) -> None:
    reference, curve = trained["tp1"][:EQUIVALENT_STEPS], trained[layout][:EQUIVALENT_STEPS]
    assert curve == pytest.approx(reference, abs=TOLERANCE), (layout, curve, reference)


def test_equivalence_check_can_fail(
    trained: dict, tiny_overrides: list[str], tmp_path: Path
) -> None:
    """A different init seed must break equality: the tolerance is tight enough to matter."""
    run_pretrain(
        1,
        [
            *tiny_overrides,
            f"output_dir={tmp_path}",
            "run_id=seed",
            "parallel.tp=1",
            "train.seed=7",
            "checkpoint.enabled=false",
        ],
    )
    curve = losses(tmp_path / "seed")[:EQUIVALENT_STEPS]
    assert max(abs(a - b) for a, b in zip(curve, trained["tp1"])) > 100 * TOLERANCE


def test_moe_expert_parallel(tiny_overrides: list[str], tmp_path: Path) -> None:
    base = [
        *tiny_overrides,
        "recipe=gpt_tiny_moe",
        f"output_dir={tmp_path}",
        "checkpoint.enabled=false",
        *EVAL,
    ]
    run_pretrain(2, [*base, "run_id=ep2", "parallel.ep=2"])
    run_pretrain(1, [*base, "run_id=ep1", "parallel.ep=1"])
    ep2, ep1 = losses(tmp_path / "ep2"), losses(tmp_path / "ep1")
    assert ep2[-1] < ep2[0] - 0.5, ep2
    assert ep2[:EQUIVALENT_STEPS] == pytest.approx(ep1[:EQUIVALENT_STEPS], abs=TOLERANCE)
    valid2, valid1 = eval_losses(tmp_path / "ep2"), eval_losses(tmp_path / "ep1")
    assert [v[:2] for v in valid2] == [("valid", 5), ("valid", 10)]
    assert valid2[0][2] == pytest.approx(valid1[0][2], abs=TOLERANCE)  # experts split over EP


@pytest.mark.gpu
def test_context_parallel_on_gpu(tiny_overrides: list[str], tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.device_count() < 2:
        pytest.skip("context parallelism needs 2 CUDA devices (Transformer Engine attention)")
    base = [
        *tiny_overrides,
        f"output_dir={tmp_path}",
        "checkpoint.enabled=false",
        "parallel.tp=1",
        "train.precision=fp32",
    ]
    run_pretrain(2, [*base, "run_id=cp2", "parallel.cp=2"])
    run_pretrain(1, [*base, "run_id=cp1"])
    cp2, cp1 = losses(tmp_path / "cp2"), losses(tmp_path / "cp1")
    assert cp2[:3] == pytest.approx(cp1[:3], abs=1e-3)
