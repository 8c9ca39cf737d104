"""What a run reports, read back: TensorBoard event files, W&B offline runs, the console, and
steps.jsonl / eval.jsonl agree value for value, and a restarted run has one curve."""

from __future__ import annotations

import json
import re

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from pretrain.model.flops import flops_per_step
from recipes import load_config
from tests.helpers import read_steps, run_pretrain

# Leg 1 only: TensorBoard, W&B, the FLOP formula and the goodput ledger are this package's code
# on either megatron-core; validation's forward-only schedule is covered on both stacks by
# tests/integration/test_training.py.
pytestmark = pytest.mark.slow
STEPS, SAVE_EVERY, KILL_AT = 10, 4, 7
CONSOLE_STEP = re.compile(
    r"step +(\d+)/\d+ \| loss ([\d.]+) \|.* ([\d.]+) TFLOP/s/device \| MFU ([\d.]+)%"
)
CONSOLE_EVAL = re.compile(r"validation at step (\d+) \| loss ([\d.]+) \| perplexity ([\d.]+)")


@pytest.fixture(scope="module")
def reported(tmp_path_factory: pytest.TempPathFactory, tiny_overrides: list[str]) -> dict:
    """Killed at step 7 (after validating at 5), relaunched: resumes from 4, redoes 5-7."""
    root = tmp_path_factory.mktemp("reporting")
    overrides = [
        *tiny_overrides,
        f"output_dir={root}",
        "run_id=rep",
        f"train.train_steps={STEPS}",
        f"checkpoint.save_interval={SAVE_EVERY}",
        "train.eval_interval=5",
        "train.eval_iters=2",
        'data.split="90,5,5"',  # a test split: evaluated once, at the end
        "train.peak_tflops=1.0",  # CPU has no known peak: give one, so MFU is reported
        "logging.wandb.enabled=true",
    ]
    killed = run_pretrain(2, [*overrides, f"train.fault=kill@{KILL_AT}:1"], check=False)
    assert killed.returncode != 0
    resumed = run_pretrain(2, overrides)
    accumulator = EventAccumulator(str(root / "rep" / "tensorboard"))
    accumulator.Reload()
    return {
        "run_dir": root / "rep",
        "overrides": overrides,
        "console": resumed.stderr,
        "tb": {tag: accumulator.Scalars(tag) for tag in accumulator.Tags()["scalars"]},
    }


def test_tensorboard_has_each_step_once_with_the_final_values(reported: dict) -> None:
    steps = read_steps(reported["run_dir"])
    events = reported["tb"]["train/loss"]
    # The failed attempt logged 5-6 after the step-4 checkpoint; purge_step dropped them.
    assert [e.step for e in events] == list(range(1, STEPS + 1))
    assert [e.value for e in events] == pytest.approx([steps[s]["loss"] for s in sorted(steps)])
    lrs = [e.value for e in reported["tb"]["train/lr"]]
    assert lrs == pytest.approx([steps[s]["lr"] for s in sorted(steps)], rel=1e-6)


def test_validation_agrees_in_console_eval_jsonl_and_tensorboard(reported: dict) -> None:
    lines = (reported["run_dir"] / "metrics" / "eval.jsonl").read_text().splitlines()
    records = [r for r in map(json.loads, lines) if r["split"] == "valid"]
    tests = [r for r in map(json.loads, lines) if r["split"] == "test"]
    assert [t["step"] for t in tests] == [STEPS] and tests[0]["loss"] != records[-1]["loss"]
    assert [(e.step, e.value) for e in reported["tb"]["test/loss"]] == [
        (STEPS, pytest.approx(tests[0]["loss"], rel=1e-6))
    ]
    final = {r["step"]: r["loss"] for r in records}  # step 5 twice: before the kill and after
    assert [r["step"] for r in records] == [5, 5, 10]
    assert records[0]["loss"] == records[1]["loss"]  # the redone validation is the same
    console = {int(s): float(loss) for s, loss, _ in CONSOLE_EVAL.findall(reported["console"])}
    assert console == pytest.approx(final, abs=1e-6)
    tb = reported["tb"]["valid/loss"]
    assert [e.step for e in tb] == sorted(final)  # each validation once
    assert [e.value for e in tb] == pytest.approx([final[s] for s in sorted(final)], rel=1e-6)
    ppl = reported["tb"]["valid/perplexity"]
    assert [e.value for e in ppl] == pytest.approx(
        [2.718281828**v for _, v in sorted(final.items())], rel=1e-5
    )


def test_throughput_follows_the_flop_formula(reported: dict) -> None:
    run = load_config(reported["overrides"])
    steps = read_steps(reported["run_dir"])
    flops = flops_per_step(
        run.model, run.train.global_batch_size, run.model.padded_vocab_size or 512
    )
    for event in reported["tb"]["throughput/tflops_per_device"]:
        record = steps[event.step]
        assert event.value == pytest.approx(flops / record["step_time_s"] / 2 / 1e12, rel=1e-5)
        assert record["tflops_per_device"] == pytest.approx(event.value, rel=1e-6)
    mfu = {e.step: e.value for e in reported["tb"]["throughput/mfu"]}
    assert mfu[3] == pytest.approx(steps[3]["tflops_per_device"] / 1.0, rel=1e-6)
    console = CONSOLE_STEP.findall(reported["console"])
    assert console, reported["console"][-3000:]
    for step, loss, _, _ in console:
        assert float(loss) == pytest.approx(steps[int(step)]["loss"], abs=1e-6)


def test_checkpoint_and_memory_scalars(reported: dict) -> None:
    run, tb = load_config(reported["overrides"]), reported["tb"]
    assert [e.step for e in tb["checkpoint/load_s"]] == [SAVE_EVERY]
    assert 0 < tb["checkpoint/load_s"][0].value < 30
    assert {e.step for e in tb["checkpoint/save_blocked_s"]} >= {8, STEPS}
    assert all(0.05 < e.value < 8 for e in tb["memory/rss_gib"])
    tokens = STEPS * run.train.global_batch_size * run.model.seq_length
    assert [e.value for e in tb["train/consumed_tokens"]][-1] == tokens


def test_goodput_ledger_reaches_tensorboard(reported: dict) -> None:
    """At the end the metrics hook hands the goodput ledger to the reporting hooks: the same
    numbers `python -m resiliency goodput` prints for the run at that moment."""
    from resiliency.monitor.goodput import CATEGORIES

    tb = reported["tb"]
    [ratio] = tb["goodput/ratio"]
    assert ratio.step == STEPS and 0 < ratio.value < 1
    seconds = {c: tb[f"goodput/{c}_s"][0].value for c in CATEGORIES}
    assert seconds["lost"] > 0 and seconds["restore"] > 0 and seconds["downtime"] > 0
    wall = sum(seconds.values())
    assert ratio.value == pytest.approx(seconds["productive"] / wall, rel=1e-5)


def test_wandb_continues_the_run_by_its_id(reported: dict) -> None:
    runs = sorted((reported["run_dir"] / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(r.name.endswith("-rep") for r in runs)  # one run, two attempts
    assert all(list(r.glob("*.wandb")) for r in runs)
