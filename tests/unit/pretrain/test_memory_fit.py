"""``python -m pretrain --plan``: the shipped GPU recipes built on the meta device at their real
layouts. Totals against the published parameter counts and the analytic count `resiliency capacity`
uses; per-stage counts against the total; memory against Megatron-LM's theoretical memory report
(its formulas, worked out here independently); the tiny recipe against what a real run
allocates."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pretrain.fit.timing import model_parameters
from recipes import load_config
from tests.helpers import REPO, TORCHRUN

LLAMA3_VOCAB, MIXTRAL_VOCAB = 128256, 32000
PUBLISHED = {"llama3_8b": 8.03e9, "llama3_70b": 70.6e9, "mixtral_8x7b": 46.7e9}
# Megatron-LM's report models neither CP's share of the optimizer sharding nor a last stage's
# logits on the first stage, so it is compared where those do not differ: CP=1, stage 0 of PP>1.
MEGATRON_CASES = {
    "70b-selective": ("recipe=llama3_70b parallel.cp=1 perf.recompute=selective launch.nodes=4"),
    "8b-tp2-pp2": (
        "recipe=llama3_8b parallel.tp=2 parallel.pp=2 parallel.cp=1 "
        "parallel.sequence_parallel=true perf.recompute=selective"
    ),
}
CASES = {
    "llama3_8b": (LLAMA3_VOCAB, "recipe=llama3_8b"),
    "llama3_70b": (LLAMA3_VOCAB, "recipe=llama3_70b"),
    "mixtral_8x7b": (MIXTRAL_VOCAB, "recipe=mixtral_8x7b"),
    "tiny-pp2": (None, "recipe=gpt_tiny parallel.tp=1 parallel.pp=2"),
    "tiny": (None, "recipe=gpt_tiny train.precision=fp32"),
    **{name: (LLAMA3_VOCAB, overrides) for name, overrides in MEGATRON_CASES.items()},
}


@pytest.fixture(scope="module")
def plans(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("plans") / "plans.json"
    cases = [f"{name}|{vocab or ''}|{ovr}" for name, (vocab, ovr) in CASES.items()]
    subprocess.run(
        [sys.executable, str(REPO / "tests" / "workers" / "plans.py"), str(out), *cases],
        cwd=REPO,
        check=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    return json.loads(out.read_text())


@pytest.mark.parametrize("recipe", sorted(PUBLISHED))
def test_shipped_recipes_have_their_published_parameter_counts(
    plans: dict[str, Any], recipe: str
) -> None:
    plan = plans[recipe]
    assert plan["published_params"] == pytest.approx(PUBLISHED[recipe], rel=0.005)
    # The analytic count `resiliency capacity` uses is the meta-built model's, to the parameter.
    vocab, overrides = CASES[recipe]
    run = load_config(overrides.split())
    padded = plan["params_by_kind"]["embedding"] // run.model.hidden_size
    assert model_parameters(run.model, padded) == plan["total_params"]
    assert plan["fits"], plan["memory"]


def test_mixtral_experts_are_most_of_it_and_sharded_over_expert_parallel(
    plans: dict[str, Any],
) -> None:
    plan = plans["mixtral_8x7b"]
    kinds = plan["params_by_kind"]
    assert kinds["experts"] / plan["total_params"] > 0.95
    for stage in plan["stages"]:  # EP=8 of 8 experts: one expert per layer on each rank
        assert stage["unique"]["experts"] == 8 * stage["local"]["experts"]


def test_stage_counts_add_up_with_a_tied_embedding_counted_once(plans: dict[str, Any]) -> None:
    plan = plans["tiny-pp2"]
    first, last = plan["stages"]
    assert sum(s["unique"][k] for s in plan["stages"] for k in s["unique"]) == plan["total_params"]
    # The last stage holds its own copy of the tied embedding as the output layer: memory on
    # that rank, not a second table in the model.
    embedding = first["local"]["embedding"]
    assert last["local"]["output"] == embedding > 0
    assert last["unique"]["output"] == 0
    local = sum(s["local"][k] for s in plan["stages"] for k in s["local"])  # TP=1: no splits
    assert local == plan["total_params"] + embedding


def _megatron_report(overrides: str, vocab: int) -> tuple[float, float]:
    """Megatron-LM's theoretical memory report (weights+optimizer, activations of the first
    stage; bytes) for a dense GPT with SP and selective recomputation, from its formulas:
    the most loaded shard holds (transformer block / pp + the embedding table) / tp parameters
    at 6 + 12/dp bytes each with the distributed optimizer; activations are
    s*b*h*(18 + 4*ffn/h) per layer for all layers, plus the embedding's 8*s*b + s*b*h per
    micro-batch for pp micro-batches, times the interleaving penalty, over tp."""
    run = load_config(overrides.split())
    m, par, train = run.model, run.parallel, run.train
    h, layers, ffn = m.hidden_size, m.num_layers, m.ffn_hidden_size
    multiple = m.make_vocab_size_divisible_by * par.tp
    padded = -(-vocab // multiple) * multiple
    kv = h // m.num_attention_heads * m.num_query_groups
    layer = 2 * h * h + 2 * h * kv + 3 * h * ffn + 2 * h  # q+o, k+v, SwiGLU, two RMSNorms
    block = layers * layer + h  # + the final norm
    shard = (block / par.pp + h * padded) / par.tp
    dp = run.launch.world_size // (par.tp * par.pp * par.cp)
    weights_and_optimizer = shard * (6 + 12 / dp)
    s, b = m.seq_length, train.micro_batch_size
    activations = s * b * h * (18 + 4 * ffn / h) * layers
    activations += (8 * s * b + s * b * h) * par.pp
    if par.vpp:
        activations *= 1 + (par.pp - 1) / (par.pp * par.vpp)
    else:
        microbatches = train.global_batch_size // (b * dp)
        activations *= min(1, microbatches / par.pp)
    return weights_and_optimizer, activations / par.tp


@pytest.mark.parametrize("case", sorted(MEGATRON_CASES))
def test_memory_matches_megatron_lms_theoretical_report(plans: dict[str, Any], case: str) -> None:
    expected_weights, expected_activations = _megatron_report(MEGATRON_CASES[case], LLAMA3_VOCAB)
    stage0 = plans[case]["memory"][0]
    ours = stage0["weights"] + stage0["grads"] + stage0["optimizer"]
    assert ours == pytest.approx(expected_weights, rel=0.001)
    assert stage0["activations"] == pytest.approx(expected_activations, rel=0.001)


def test_tiny_plan_matches_what_a_real_run_allocates(
    plans: dict[str, Any], tiny_overrides: list[str], tmp_path: Path
) -> None:
    out = tmp_path / "allocated.json"
    subprocess.run(
        [
            TORCHRUN,
            "--standalone",
            "--nproc-per-node=2",
            str(REPO / "tests" / "workers" / "allocated_state.py"),
            f"--out={out}",
            *tiny_overrides,
            "train.precision=fp32",
            f"output_dir={tmp_path}",
            "run_id=alloc",
        ],
        cwd=REPO,
        check=True,
        timeout=300,
        capture_output=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    allocated = json.loads(out.read_text())
    planned = plans["tiny"]["memory"][0]
    for rank in allocated:
        for key in ("weights", "grads", "optimizer"):
            assert rank[key] == pytest.approx(planned[key], rel=0.03), (key, rank, planned)


@pytest.mark.parametrize("backend", ["slurm", "k8s"])
def test_a_submission_that_does_not_fit_is_refused_with_the_fix(
    backend: str, stdlib_corpus: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """gpt_125m's activations (micro-batch 8, sequence 2048) do not fit an 8 GiB GPU; full
    recomputation would. Refused before anything is written or submitted."""
    from launch.__main__ import main as launch_main
    from pretrain.context import exit_codes
    from tests.k8s_helpers import BASE, GPT

    argv = [f"output_dir={tmp_path}", "launch.gpu=8"]
    if backend == "slurm":
        argv += ["recipe=gpt_125m", f"data.paths=[{stdlib_corpus}]", "run_id=big"]
    else:
        argv += [*GPT, *BASE, "run_id=big"]
    assert launch_main([backend, *argv]) == exit_codes.CONFIG_ERROR
    err = capsys.readouterr().err
    assert "does not fit 8: pipeline stage 0 needs" in err, err
    assert "smallest change that fits: perf.recompute=full" in err, err
    assert not (tmp_path / "big").exists() or not any((tmp_path / "big").iterdir())


@pytest.mark.current_stack
def test_the_plan_builds_on_either_megatron_core(tmp_path: Path) -> None:
    """The current-stack leg runs this one: the 70B layout (VPP, SP, CP) built on meta and
    its published count, through the CLI as a user runs it."""
    proc = subprocess.run(
        [sys.executable, "-m", "pretrain", "recipe=llama3_70b", "--plan", "--json"]
        + ["--vocab", str(LLAMA3_VOCAB)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = json.loads(proc.stdout.strip().splitlines()[-1])
    assert plan["published_params"] == pytest.approx(PUBLISHED["llama3_70b"], rel=0.005)
    assert [s["chunks"] for s in plan["stages"]] == [5] * 4
