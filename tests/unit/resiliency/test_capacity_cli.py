"""``python -m resiliency capacity`` through the real CLI: the interval in steps from a step time or
a recipe, and the recipe's parameter count against megatron-core's own (pretrain.train.trainer logs
"N params on this rank"; the figures below are that line at TP=PP=EP=1)."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from pretrain.model.flops import flops_per_step
from recipes import load_config

REPO = Path(__file__).resolve().parents[3]
YOUNG_S = math.sqrt(2 * 30 * 3 * 3600)  # 30 s save, 3 h MTBF -> 804.98 s
DEFAULTS = ("--save-seconds", "30", "--mtbf", "3h")  # else a recipe's planning keys


def plan(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "resiliency", "plan", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def line(stdout: str, prefix: str) -> str:
    return next(ln.strip() for ln in stdout.splitlines() if ln.strip().startswith(prefix))


def test_step_time_gives_the_interval_in_steps() -> None:
    out = plan("--params", "70e9", "--mtbf", "3h", "--save-seconds", "30", "--step-time", "6s")
    assert out.returncode == 0, out.stdout + out.stderr
    assert round(YOUNG_S / 6) == 134
    assert line(out.stdout, "in steps:") == (
        "in steps: 13.4 min / 6 s per step = 134 steps -> checkpoint.save_interval=134"
    )
    assert line(out.stdout, "step time:") == "step time: 6 s (--step-time)"
    assert "keeping 3 version(s): 2.94 TB" in out.stdout  # unchanged: keep_last 2 + 1
    assert line(out.stdout, "checkpoint.keep_last=") == (
        "checkpoint.keep_last=2 (schema default) + 1 being written"
    )


def test_without_step_time_says_how_to_get_steps() -> None:
    out = plan("--params", "7B")
    assert out.returncode == 0, out.stdout
    assert line(out.stdout, "in steps:") == (
        "in steps: give --step-time, or recipe=<name> to estimate it"
    )


def test_recipe_estimates_step_time_and_counts_parameters() -> None:
    """llama3_8b: Meta's published 8,030,261,248 parameters; the step time is FLOPs per step
    over 16 H100s at 989 TFLOP/s and 40 % MFU."""
    out = plan("recipe=llama3_8b", "--gpu", "h100", "--vocab", "128256", *DEFAULTS)
    assert out.returncode == 0, out.stdout + out.stderr
    assert line(out.stdout, "Checkpoint plan for") == (
        "Checkpoint plan for 8.03026B parameters (8,030,261,248 in recipe llama3_8b, "
        "padded vocab 128256 (--vocab 128256))"
    )
    run = load_config(["recipe=llama3_8b"])
    step_s = flops_per_step(run.model, 512, 128256) / (16 * 989e12 * 0.40)
    steps = round(YOUNG_S / step_s)
    assert steps == 21
    assert line(out.stdout, "in steps:") == (
        f"in steps: 13.4 min / {step_s:.3g} s per step = {steps} steps -> "
        f"checkpoint.save_interval={steps}"
    )
    assert line(out.stdout, "step time:").startswith(f"step time: {step_s:.3g} s (estimated: ")
    assert "(16 GPUs x 989 TFLOP/s bf16 x 40% MFU, assumed)" in out.stdout
    assert line(out.stdout, "recipe llama3_8b").startswith("recipe llama3_8b saves with auto: ")


def test_step_time_flag_wins_over_the_estimate() -> None:
    out = plan("recipe=gpt_tiny", "--step-time", "2", "--gpu", "H100", *DEFAULTS)
    assert out.returncode == 0, out.stdout + out.stderr
    assert line(out.stdout, "in steps:") == (
        "in steps: 13.4 min / 2 s per step = 402 steps -> checkpoint.save_interval=402"
    )
    assert line(out.stdout, "recipe gpt_tiny") == (
        "recipe gpt_tiny saves every 10 steps = 20 s (its checkpoint.save_interval)"
    )


@pytest.mark.parametrize(
    "overrides, megatron_count",
    [
        (["recipe=gpt_tiny"], 232_832),  # LayerNorm, GELU, biases, tied embeddings
        (
            [
                "recipe=gpt_tiny",
                "model.activation=swiglu",
                "model.normalization=RMSNorm",
                "model.num_query_groups=2",
                "model.add_bias_linear=false",
                "model.share_embeddings_and_output_weights=false",
            ],
            311_872,
        ),
        (["recipe=gpt_tiny_moe"], 362_624),  # router + 4 experts per layer
        (["recipe=gpt_tiny", "model.position_embedding_type=learned_absolute"], 236_928),
    ],
)
def test_recipe_parameter_count_matches_megatron(overrides: list[str], megatron_count: int) -> None:
    out = plan(*overrides, "--keep", "2")
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"({megatron_count:,} in recipe " in out.stdout, out.stdout.splitlines()[0]
    assert line(out.stdout, "Storage, keeping 2 version(s):")  # --keep wins over the recipe


def test_recipe_without_gpu_says_what_is_missing() -> None:
    out = plan("recipe=gpt_tiny")
    assert out.returncode == 0, out.stdout
    assert line(out.stdout, "in steps:") == (
        "in steps: a CPU run: give train.step_time_s (--step-time), or --gpu (A100, H100, H200)"
    )


def test_a_recipe_plans_from_its_own_vocabulary() -> None:
    out = plan("recipe=llama3_8b")  # no --vocab, no tokenizer files: data.vocab_size
    assert out.returncode == 0, out.stdout + out.stderr
    assert "padded vocab 128256 (data.vocab_size 128256)" in out.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (
            # the tokenizer files are not in the repo, and the recipe's own size is taken away
            ["recipe=llama3_8b", "data.vocab_size=null"],
            "error: recipe llama3_8b: cannot count its parameters, tokenizer tokenizers/llama3: ",
        ),
        (["train.train_steps=3"], "error: no recipe chosen: add recipe=<name>"),
        (["recipe=nope"], "error: unknown recipe 'nope'"),
        (["recipe=gpt_tiny", "--mfu", "1.5"], "error: --mfu must be in (0, 1], got 1.5"),
        ([], "error: give --params (e.g. 70e9, 7B), or recipe=<name>"),
        (["--params", "7B", "--step-time", "soon"], "error: cannot read 'soon' as a duration"),
    ],
)
def test_usage_errors_exit_2_with_one_line(args: list[str], message: str) -> None:
    out = plan(*args)
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stdout.startswith(message), out.stdout
    assert len(out.stdout.splitlines()) == 1 and "Traceback" not in out.stderr
