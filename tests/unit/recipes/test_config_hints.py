"""Where users stumble on the override grammar, the error says the fix: a key added to a dict
needs '+', a comma value is a sweep (-m), a Megatron-LM / Bridge name maps to ours."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pretrain.context import exit_codes
from recipes import ConfigError, load_config
from recipes.load import schema_keys
from recipes.megatron_names import MEGATRON_NAMES
from tests.helpers import REPO


@pytest.mark.parametrize("name, ours", sorted(MEGATRON_NAMES.items()))
def test_every_megatron_name_maps_to_a_real_key(name: str, ours: str) -> None:
    assert ours in schema_keys(), (name, ours)
    assert name not in {key.rsplit(".", 1)[-1] for key in schema_keys()}  # not ours as well


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.tensor_model_parallel_size=2",
         "unknown config key 'model.tensor_model_parallel_size': that is parallel.tp here"),
        ("train_iters=100", "unknown config key 'train_iters': that is train.train_steps here"),
        ("launch.slurm.env.NCCL_DEBUG=INFO",
         "launch.slurm.env is a dict, and Hydra adds a key to it only with '+': "
         "+launch.slurm.env.NCCL_DEBUG=<value>"),
        ("optimizer.lr=1e-3,3e-3",
         "optimizer.lr=1e-3,3e-3: a comma makes a sweep; add -m to run one job per value, or "
         "write optimizer.lr=[1e-3,3e-3] for a list"),
    ],
)  # fmt: skip
def test_the_error_names_the_fix(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(["recipe=gpt_tiny", override])
    assert message in str(err.value)


def test_the_fixed_forms_are_accepted() -> None:
    run = load_config(["recipe=gpt_tiny", "+launch.slurm.env.NCCL_DEBUG=INFO"])
    assert run.launch.slurm.env["NCCL_DEBUG"] == "INFO"


def test_through_the_cli_one_line_and_exit_2() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pretrain", "recipe=gpt_tiny", "model.tensor_model_parallel_size=2"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == exit_codes.CONFIG_ERROR
    assert "that is parallel.tp here" in proc.stderr and "Traceback" not in proc.stderr


def test_a_multi_rank_layout_without_a_launcher_names_the_launch_lines(stdlib_corpus: str) -> None:
    overrides = ["recipe=gpt_tiny", f"data.paths=[{stdlib_corpus}]", "parallel.tp=2", "run_id=x"]
    env = {k: v for k, v in os.environ.items() if k != "WORLD_SIZE"}
    out = subprocess.run(
        [sys.executable, "-m", "pretrain", *overrides],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == exit_codes.CONFIG_ERROR
    [line] = [ln for ln in out.stderr.splitlines() if "config error" in ln]
    assert "world size 1 is not divisible by tp*pp*cp" in line
    assert f"torchrun --standalone --nproc-per-node 2 -m pretrain {' '.join(overrides)}" in line
    assert "python -m launch local launch.nproc_per_node=2" in line
