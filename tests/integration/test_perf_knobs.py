"""Performance knobs reach megatron-core and change speed or memory, never the numbers: on CPU,
selective and full recompute and the overlapped gradient reduce train the same losses; the
GPU-only ones are refused on CPU before anything starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pretrain.model.gpt import perf_settings
from recipes import ConfigError, load_config
from recipes.validate import validate_runtime
from tests.helpers import REPO, losses, run_pretrain

KNOBS = {
    "selective": ["parallel.tp=2", "perf.recompute=selective"],
    "full": ["parallel.tp=2", "perf.recompute=full", "perf.recompute_num_layers=2"],
    "block": [
        "parallel.tp=1",
        "parallel.pp=2",
        "perf.recompute=full",
        "perf.recompute_method=block",
    ],
    "overlap": ["parallel.tp=1", "perf.overlap_grad_reduce=true"],
}
BASELINES = {"selective": "tp2", "full": "tp2", "block": "pp2", "overlap": "dp2"}
LAYOUTS = {
    "tp2": ["parallel.tp=2"],
    "pp2": ["parallel.tp=1", "parallel.pp=2"],
    "dp2": ["parallel.tp=1"],
}


def test_knobs_map_to_megatron_fields() -> None:
    run = load_config(["recipe=gpt_tiny", "perf.recompute=full", "perf.recompute_method=block"])
    assert perf_settings(run.perf) == {
        "recompute_granularity": "full",
        "recompute_method": "block",
        "recompute_num_layers": 1,
    }
    mixtral = load_config(["recipe=mixtral_8x7b"]).perf
    assert perf_settings(mixtral) == {"recompute_granularity": "selective"}
    assert mixtral.overlap_grad_reduce and mixtral.overlap_param_gather
    assert perf_settings(load_config(["recipe=llama3_70b"]).perf) == {"tp_comm_overlap": True}


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["perf.fp8=hybrid"], "perf.fp8=hybrid needs Transformer Engine on a CUDA GPU"),
        (["perf.tp_comm_overlap=true"], "perf.tp_comm_overlap=true needs Transformer Engine"),
    ],
)
def test_gpu_only_knobs_are_refused_on_cpu(overrides: list[str], message: str) -> None:
    run = load_config(["recipe=gpt_tiny", *overrides])
    with pytest.raises(ConfigError, match=message):
        validate_runtime(run, 2, "cpu")
    assert validate_runtime(run, 2, "cuda") == 1  # fine where TE runs


def test_inconsistent_knobs_are_one_line_errors() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pretrain", "recipe=gpt_tiny", "perf.overlap_param_gather=true"],
        cwd=REPO,
        text=True,
        capture_output=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "perf.overlap_param_gather=true needs perf.overlap_grad_reduce=true" in proc.stderr
    with pytest.raises(ConfigError, match="use_distributed_optimizer"):
        load_config(
            [
                "recipe=gpt_tiny",
                "perf.overlap_grad_reduce=true",
                "perf.overlap_param_gather=true",
                "optimizer.use_distributed_optimizer=false",
            ]
        )


@pytest.fixture(scope="module")
def baselines(tmp_path_factory: pytest.TempPathFactory, tiny_overrides: list[str]) -> dict:
    root = tmp_path_factory.mktemp("perf-base")
    for name, layout in LAYOUTS.items():
        run_pretrain(
            2,
            [
                *tiny_overrides,
                f"output_dir={root}",
                f"run_id={name}",
                "checkpoint.enabled=false",
                *layout,
            ],
        )
    return {name: losses(root / name) for name in LAYOUTS}


@pytest.mark.slow
@pytest.mark.current_stack
@pytest.mark.parametrize("knob", list(KNOBS))
def test_knob_trains_the_same_losses(
    baselines: dict, tiny_overrides: list[str], tmp_path: Path, knob: str
) -> None:
    run_pretrain(
        2,
        [
            *tiny_overrides,
            f"output_dir={tmp_path}",
            "run_id=k",
            "checkpoint.enabled=false",
            *KNOBS[knob],
        ],
    )
    assert losses(tmp_path / "k") == pytest.approx(baselines[BASELINES[knob]], abs=1e-6)
