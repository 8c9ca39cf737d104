"""The numeric guard (train.guard): the spike rule, the policies' decisions, and each policy's
exact effect on a real TP=2 trajectory with an injected NaN and an injected loss spike.

Cross-checks between independent mechanisms, bit for bit:
- skip at step 5 == rollback from step 5 to a step-4 checkpoint, one step later: both drop
  batch 5's update, neither advances the LR schedule for it (Megatron-LM's rule), one by not
  stepping the optimizer, the other by loading step 4's weights from disk;
- an in-process rollback == a new launch that restores a copy of the step-4 checkpoint whose
  data cursor was moved past the bad batch by hand.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pretrain.context import exit_codes
from pretrain.context.failures import NonFiniteError, classify
from pretrain.train.fault_injection import FaultInjector
from pretrain.train.guard import LossSpikeError, NumericGuard, SpikeWindow, nonfinite_grads
from pretrain.train.hooks import StepResult
from recipes import ConfigError, load_config
from recipes.config.train import GuardConfig
from resiliency.checkpoint.restore.resume_policy import classify_key
from resiliency.storage.layout import RunLayout
from tests.helpers import REPO, read_steps, recommit_file, run_pretrain

GBS = 8  # tiny_overrides' global batch
SPIKE = ["train.guard.spike_sigma=6", "train.guard.spike_window=3"]
KEYS = ("loss", "grad_norm", "lr")


# ---------------------------------------------------------------- the spike rule
def test_spike_limit_is_mean_plus_sigma_sample_std() -> None:
    window = SpikeWindow(sigma=2.0, size=3)
    for loss in (1.0, 2.0, 3.0):
        assert window.judge(loss) is None  # no verdict before the window is full
    assert window.limit() == (4.0, 2.0, 1.0)  # mean 2, sample std 1
    assert window.judge(4.0) is None  # not above the limit
    assert window.limit() == (5.0, 3.0, 1.0)  # (2, 3, 4): the first loss left
    verdict = window.judge(5.0 + 1e-9)
    assert verdict is not None and verdict.startswith("loss spike: 5 > 5 (mean 3 + 2 x std 1")


def test_a_drop_is_not_a_spike_and_a_spike_stays_in_the_window() -> None:
    window = SpikeWindow(sigma=3.0, size=4)
    for loss in (5.0, 5.1, 4.9, 5.0):
        window.judge(loss)
    assert window.judge(0.1) is None  # one-sided
    assert window.judge(100.0) is not None
    assert list(window.losses) == [4.9, 5.0, 0.1, 100.0]  # OLMo-core: every finite loss counts


def _result(
    step: int = 5, *, loss: float = 1.0, skipped: bool = True, anomaly: str = "x"
) -> StepResult:
    return StepResult(step, loss, float("nan"), 1e-3, 0.1, 1.0, skipped=skipped, anomaly=anomaly)


def test_inspect_orders_verdicts_and_keeps_non_finite_out_of_the_window() -> None:
    guard = NumericGuard(GuardConfig(policy="skip", spike_sigma=1.0, spike_window=2))
    assert guard.active and guard.checks_grads
    assert guard.inspect(float("nan"), False) == "non-finite loss nan"
    assert guard.inspect(1.0, False) is None
    assert guard.inspect(1.0, True) == "non-finite gradients"
    assert guard.window is not None and list(guard.window.losses) == [1.0, 1.0]
    assert guard.inspect(1.5, False) == (
        "loss spike: 1.5 > 1 (mean 1 + 1 x std 0 of the last 2 losses)"
    )


def test_the_default_guard_is_off() -> None:
    guard = NumericGuard(GuardConfig())
    assert not guard.active and not guard.checks_grads and guard.window is None
    stop_only_spikes = NumericGuard(GuardConfig(spike_sigma=6.0))
    assert stop_only_spikes.active and not stop_only_spikes.checks_grads


def test_policy_decisions_and_the_rollback_budget() -> None:
    assert NumericGuard(GuardConfig()).action(_result()) == "stop"
    skip = NumericGuard(GuardConfig(policy="skip"))
    assert skip.action(_result()) == "skip"
    assert skip.action(_result(skipped=False)) == "stop"  # applied already: cannot be skipped
    rollback = NumericGuard(GuardConfig(policy="rollback", max_rollbacks=1))
    assert rollback.action(_result(skipped=False)) == "rollback"
    rollback.rolled_back(_result(), restored=4, window=(32, 40), action="rollback")
    assert rollback.action(_result()) == "stop"
    error = rollback.stop_error(_result(anomaly="loss spike: 9 > 1"))
    assert isinstance(error, LossSpikeError) and "max_rollbacks=1 spent" in str(error)
    assert classify(error).exit_code == exit_codes.NUMERIC and not classify(error).retryable
    plain = NumericGuard(GuardConfig()).stop_error(_result(loss=2.5, skipped=False))
    assert type(plain) is NonFiniteError
    assert str(plain) == "step 5: loss 2.5, grad norm nan; not retrying a numeric failure"


def test_replay_first_then_rollback_when_the_same_step_fails_again() -> None:
    """A transient fault does not recur on a replay; an anomaly that does is the data's."""
    replay = NumericGuard(GuardConfig(policy="replay", max_rollbacks=3))
    assert replay.action(_result(step=7)) == "replay"
    replay.rolled_back(_result(step=7), restored=4, window=(32, 32), action="replay")
    assert replay.skipped_samples == 0 and replay.events[-1]["action"] == "replay"
    assert replay.action(_result(step=9)) == "replay"  # another step: replayed first too
    assert replay.action(_result(step=7)) == "rollback"  # step 7 again: skip its data
    replay.rolled_back(_result(step=7), restored=4, window=(32, 64), action="rollback")
    assert (replay.rollbacks, replay.skipped_samples) == (2, 32)
    replay.rolled_back(_result(step=9), restored=8, window=(72, 72), action="replay")
    assert replay.action(_result(step=11)) == "stop"  # three spent
    assert "max_rollbacks=3 spent" in str(replay.stop_error(_result(step=11)))


def test_sdc_poisons_a_step_once_and_nan_every_time() -> None:
    grads = torch.zeros(4)
    chunk = SimpleNamespace(parameters=lambda: [SimpleNamespace(main_grad=grads)])
    faults = FaultInjector.parse("sdc@3;nan@5", rank=0)
    for step, poisoned in ((3, True), (3, False), (5, True), (5, True)):
        grads.zero_()
        faults.after_backward(step, [chunk])
        assert bool(grads.isnan().all()) is poisoned, step


def test_state_round_trip_and_totals_never_go_back() -> None:
    guard = NumericGuard(GuardConfig(policy="rollback", spike_sigma=6.0, spike_window=3))
    for loss in (3.0, 2.0, 1.0, 0.5):
        guard.inspect(loss, False)
    guard.skipped(_result(), samples=8)
    saved = json.loads(json.dumps(guard.state_dict()))
    assert saved == {
        "losses": [2.0, 1.0, 0.5],
        "skipped_steps": 1,
        "rollbacks": 0,
        "skipped_samples": 8,
    }
    guard.inspect(9.0, False)
    guard.rolled_back(_result(), restored=4, window=(32, 48), action="rollback")
    guard.load_state_dict(saved)  # an in-process rollback to the checkpoint saved above
    assert guard.window is not None and list(guard.window.losses) == [2.0, 1.0, 0.5]
    assert (guard.rollbacks, guard.skipped_samples) == (1, 24)
    fresh = NumericGuard(GuardConfig(spike_sigma=6.0, spike_window=2))
    fresh.load_state_dict(saved)
    assert list(fresh.window.losses) == [1.0, 0.5] and fresh.skipped_steps == 1
    fresh.load_state_dict(None)  # a checkpoint from before the guard: nothing changes
    assert fresh.skipped_steps == 1


def test_nonfinite_grads_sees_nan_and_inf_in_any_buffer() -> None:
    def chunk(*values: float) -> SimpleNamespace:
        return SimpleNamespace(buffers=[SimpleNamespace(grad_data=torch.tensor(values))])

    assert nonfinite_grads([chunk(1.0, -2.0), chunk(3e30)]).item() == 0.0
    assert nonfinite_grads([chunk(1.0), chunk(float("nan"))]).item() == 1.0
    assert nonfinite_grads([chunk(float("inf"), float("-inf"))]).item() == 1.0


@pytest.mark.parametrize(
    "overrides, problem",
    [
        ({"policy": "retry"}, "train.guard.policy='retry' is not one of"),
        ({"spike_sigma": 0.0}, "spike_sigma must be > 0"),
        ({"spike_window": 1}, "spike_window must be >= 2"),
        ({"policy": "rollback", "max_rollbacks": 0}, "needs train.guard.max_rollbacks >= 1"),
    ],
)
def test_config_is_validated(overrides: dict, problem: str) -> None:
    with pytest.raises(ConfigError, match=problem):
        GuardConfig(**overrides)


def test_guard_keys_load_and_may_change_on_resume() -> None:
    run = load_config(["recipe=gpt_tiny", "train.guard.policy=rollback", *SPIKE])
    assert (run.train.guard.policy, run.train.guard.spike_sigma) == ("rollback", 6.0)
    assert load_config(["recipe=gpt_tiny"]).train.guard == GuardConfig()
    assert {classify_key(f"train.guard.{k}") for k in vars(GuardConfig())} == {"free"}


def test_spike_fault_scales_the_loss_of_one_batch() -> None:
    faults = FaultInjector.parse("spike@5;spike@7::50;spike@9:1:2", rank=0)
    assert [faults.loss_scale(b) for b in (4, 5, 6, 7, 9)] == [1.0, 1000.0, 1.0, 50.0, 1.0]
    assert FaultInjector.parse("spike@9:1:2", rank=1).loss_scale(9) == 2.0
    for bad in ("spike@5::0.5", "nan@5::2", "spike@x"):
        with pytest.raises(ValueError, match="spike@<batch>"):
            FaultInjector.parse(bad, rank=0)


# ---------------------------------------------------------------- real runs (TP=2)
def _launch(tiny: list[str], root: Path, name: str, *extra: str, ok: bool = True) -> Path:
    """A TP=2 run; one expected to fail goes through python -m launch.torchrun, whose exit code
    is the failing rank's (bare torchrun says 1)."""
    overrides = [*tiny, f"output_dir={root}", f"run_id={name}", "scheduler.decay_steps=12"]
    if ok:
        run_pretrain(2, [*overrides, *extra])
        return root / name
    launcher = [sys.executable, "-m", "launch.torchrun", "--standalone", "--nproc-per-node=2"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [*launcher, "-m", "pretrain", *overrides, *extra],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == exit_codes.NUMERIC, proc.stderr[-3000:]
    return root / name


def _attempt(run_dir: Path) -> dict:
    return json.loads((run_dir / "attempts" / "attempt-01.json").read_text())


def _train_state(run_dir: Path, step: int) -> dict:
    step_dir = RunLayout(run_dir.parent, run_dir.name).step_dir(step)
    return json.loads((step_dir / "train_state.json").read_text())


def _records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics" / "steps.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def _same(a: dict, b: dict) -> bool:
    return all(a[k] == b[k] for k in KEYS)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("guard")


@pytest.fixture(scope="module")
def stopped(root: Path, tiny_overrides: list[str]) -> Path:
    """Today's behaviour (no guard settings): a NaN gradient at step 5 ends the run."""
    return _launch(tiny_overrides, root, "stop", "train.fault=nan@5", ok=False)


@pytest.fixture(scope="module")
def skipped(root: Path, tiny_overrides: list[str]) -> Path:
    """NaN gradients at step 5, a 1000x loss spike at 9, an inf loss (a real NaN in the
    backward pass, which megatron's own check would raise on) at 10."""
    faults = 'train.fault="nan@5;spike@9;spike@10::inf"'
    return _launch(
        tiny_overrides,
        root,
        "skip",
        "train.guard.policy=skip",
        *SPIKE,
        faults,
        "train.train_steps=10",
    )


@pytest.fixture(scope="module")
def rolled_back(root: Path, tiny_overrides: list[str]) -> Path:
    return _launch(
        tiny_overrides,
        root,
        "rollback",
        "train.guard.policy=rollback",
        *SPIKE,
        "train.fault=spike@5",
        "checkpoint.save_interval=4",
        "train.train_steps=8",
    )


@pytest.mark.slow
@pytest.mark.current_stack
def test_stop_exits_numeric_as_before(stopped: Path) -> None:
    steps = read_steps(stopped)
    assert sorted(steps) == [1, 2, 3, 4, 5] and steps[5]["grad_norm"] != steps[5]["grad_norm"]
    attempt = _attempt(stopped)
    assert (attempt["status"], attempt["exit_code"]) == ("failed", exit_codes.NUMERIC)
    assert attempt["failure_class"] == "numeric" and "not retrying" in attempt["error"]
    assert attempt["guard"]["events"][0]["action"] == "stop"


@pytest.mark.slow
@pytest.mark.current_stack
def test_skip_drops_the_update_and_holds_the_schedule(stopped: Path, skipped: Path) -> None:
    clean, skip = read_steps(stopped), read_steps(skipped)
    # The guard judging every step changes nothing until it acts.
    assert all(_same(skip[s], clean[s]) for s in range(1, 5))
    assert skip[5]["loss"] == clean[5]["loss"] and skip[5]["lr"] == clean[5]["lr"]
    assert skip[5]["skipped"] and skip[5]["anomaly"] == "non-finite gradients"
    assert skip[5]["grad_norm"] != skip[5]["grad_norm"]  # NaN: no norm of NaN gradients
    assert skip[6]["lr"] == skip[5]["lr"]  # the schedule did not advance for the skipped step
    assert skip[6]["loss"] != clean[5]["loss"] and not skip[6]["skipped"]
    assert skip[9]["skipped"] and skip[9]["anomaly"].startswith("loss spike: ")
    assert skip[10]["skipped"] and skip[10]["anomaly"] == "non-finite loss inf"
    assert [s for s in skip if skip[s]["skipped"]] == [5, 9, 10]
    state = _train_state(skipped, 10)  # step and cursor advanced through every skip
    assert (state["step"], state["consumed_samples"], state["scheduler"]["num_steps"]) == (
        10,
        10 * GBS,
        7,
    )
    guard = _attempt(skipped)["guard"]
    assert (guard["skipped_steps"], guard["skipped_samples"], guard["rollbacks"]) == (3, 24, 0)
    assert [e["step"] for e in guard["events"]] == [5, 9, 10]
    assert state["guard"]["skipped_steps"] == 3


# Leg 1 only (two launches): a rollback is a restore in place, through the checkpointer the
# current-stack leg's resume tests cover; stop and skip run on both stacks above.
@pytest.mark.slow
def test_skip_equals_a_rollback_to_the_step_before(
    stopped: Path, skipped: Path, rolled_back: Path
) -> None:
    clean, skip, back = read_steps(stopped), read_steps(skipped), read_steps(rolled_back)
    assert all(_same(back[s], clean[s]) for s in range(1, 5))
    first_try = [r for r in _records(rolled_back) if r["step"] == 5][0]
    assert first_try["skipped"] and first_try["anomaly"].startswith("loss spike: ")
    assert first_try["loss"] == pytest.approx(1000 * clean[5]["loss"], rel=1e-6)
    # Skipping step 5 == restoring step 4 from disk and training on from batch 6.
    assert all(_same(back[s], skip[s + 1]) for s in range(5, 8))
    # The spike fault hits batch 9 only in the skip run: the state before it is the same.
    assert skip[9]["loss"] == pytest.approx(1000 * back[8]["loss"], rel=1e-6)
    state = _train_state(rolled_back, 8)
    assert (state["step"], state["consumed_samples"]) == (8, 9 * GBS)  # one batch skipped
    assert state["guard"]["rollbacks"] == 1 and state["guard"]["skipped_samples"] == GBS
    event = _attempt(rolled_back)["guard"]["events"][0]
    assert (event["action"], event["restored_step"], event["skipped_samples"]) == (
        "rollback",
        4,
        [4 * GBS, 5 * GBS],
    )


@pytest.mark.slow
def test_rollback_equals_a_resume_with_the_window_skipped(
    root: Path, rolled_back: Path, tiny_overrides: list[str]
) -> None:
    """A copy of the step-4 checkpoint whose cursor is moved past batch 5 by hand, resumed by
    a new launch, trains exactly what the in-process rollback trained."""
    forged = root / "forged" / "rollback"  # same run id: the manifest names it
    step4 = RunLayout(root, "rollback").step_dir(4)
    shutil.copytree(step4, forged / "steps" / step4.name)
    state = _train_state(rolled_back, 4)
    state["consumed_samples"] = state["data_cursor"]["consumed_samples"] = 5 * GBS
    state["consumed_tokens"] += GBS * 64  # gpt_tiny: seq_length 64
    (forged / "steps" / step4.name / "train_state.json").write_text(json.dumps(state))
    recommit_file(forged / "steps" / step4.name, "train_state.json")
    _launch(
        tiny_overrides,
        root / "forged",
        "rollback",
        "train.guard.policy=rollback",
        *SPIKE,
        "checkpoint.save_interval=4",
        "train.train_steps=8",
    )
    back, resumed = read_steps(rolled_back), read_steps(forged)
    assert sorted(resumed) == [5, 6, 7, 8]
    assert all(_same(resumed[s], back[s]) for s in range(5, 9))
    ours, theirs = _train_state(rolled_back, 8), _train_state(forged, 8)
    for key in ("consumed_samples", "consumed_tokens", "lr", "scheduler"):
        assert ours[key] == theirs[key], key
    assert ours["guard"]["losses"] == theirs["guard"]["losses"]


@pytest.mark.slow
def test_rollback_budget_then_stop(root: Path, tiny_overrides: list[str], skipped: Path) -> None:
    """nan@5 poisons step 5 whatever it trains on: one rollback, then the budget is spent."""
    run_dir = _launch(
        tiny_overrides,
        root,
        "budget",
        "train.guard.policy=rollback",
        "train.guard.max_rollbacks=1",
        "train.fault=nan@5",
        "checkpoint.save_interval=4",
        "train.train_steps=8",
        ok=False,
    )
    fives = [r for r in _records(run_dir) if r["step"] == 5]
    assert [r["anomaly"] for r in fives] == ["non-finite gradients"] * 2
    assert fives[1]["loss"] == read_steps(skipped)[6]["loss"]  # step 5 after it: batch 6
    attempt = _attempt(run_dir)
    assert attempt["failure_class"] == "numeric" and "max_rollbacks=1 spent" in attempt["error"]
    guard = attempt["guard"]
    assert [e["action"] for e in guard["events"]] == ["rollback", "stop"]
    assert guard["rollbacks"] == 1


@pytest.mark.slow
def test_stop_on_a_spike(root: Path, tiny_overrides: list[str], stopped: Path) -> None:
    run_dir = _launch(tiny_overrides, root, "stop-spike", *SPIKE, "train.fault=spike@5", ok=False)
    steps, clean = read_steps(run_dir), read_steps(stopped)
    assert all(_same(steps[s], clean[s]) for s in range(1, 5)) and max(steps) == 5
    assert "LossSpikeError: step 5: loss spike: " in _attempt(run_dir)["error"]
