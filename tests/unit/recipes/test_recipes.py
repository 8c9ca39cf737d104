"""Every shipped recipe composes and validates offline; bad input fails with a clear message."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from recipes import ConfigError, list_recipes, load_config
from recipes.validate import validate_runtime
from tests.helpers import REPO

SHIPPED = [
    "gpt_tiny",
    "gpt_tiny_bpe",
    "gpt_tiny_moe",
    "gpt_125m",
    "llama3_8b",
    "llama3_70b",
    "mixtral_8x7b",
]


def test_all_recipes_are_listed() -> None:
    assert sorted(SHIPPED) == list_recipes()


@pytest.mark.parametrize("recipe", SHIPPED)
def test_recipe_composes_and_validates(recipe: str) -> None:
    run = load_config([f"recipe={recipe}"])
    assert run.run_id is None  # a recipe names no run: each launch starts one (README "Resume")
    device = "cpu" if recipe.startswith("gpt_tiny") else "cuda"
    dp = validate_runtime(run, run.launch.world_size, device)
    par = run.parallel
    assert par.tp * par.pp * par.cp * dp == run.launch.world_size


def test_size_variant_is_a_delta() -> None:
    small, big = load_config(["recipe=llama3_8b"]), load_config(["recipe=llama3_70b"])
    assert (big.model.num_layers, big.model.hidden_size) == (80, 8192)
    assert big.model.ffn_hidden_size == 28672 and big.model.num_query_groups == 8
    assert big.model.normalization == small.model.normalization == "RMSNorm"
    assert big.data == small.data


def test_overrides_use_hydra_grammar() -> None:
    run = load_config(
        [
            "recipe=gpt_tiny",
            "parallel.tp=1",
            "train.global_batch_size=32",
            "data.paths=[a,b]",
            "data.weights=[0.3,0.7]",
        ]
    )
    assert (run.parallel.tp, run.train.global_batch_size) == (1, 32)
    assert run.data.paths == ["a", "b"] and run.data.weights == [0.3, 0.7]


@pytest.mark.parametrize(
    "override, expected",
    [
        ("train.global_batch_sizee=16", "Did you mean: train.global_batch_size"),
        ("trian.seed=1", "Did you mean: train.seed"),
        ("+parallel.tensor_parallel=2", "unknown config key 'parallel.tensor_parallel'"),
        ("recipe=gpt_tinyy", "unknown recipe 'gpt_tinyy'"),
        ("train.seed=abc", "train.seed"),
    ],
)
def test_bad_override_names_the_problem(override: str, expected: str) -> None:
    overrides = [override] if override.startswith("recipe=") else ["recipe=gpt_tiny", override]
    with pytest.raises(ConfigError, match=expected.replace("+", r"\+").replace(".", r"\.")):
        load_config(overrides)


def test_missing_recipe_lists_choices() -> None:
    with pytest.raises(ConfigError, match="recipe=<name>.*gpt_tiny"):
        load_config([])


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["parallel.tp=3"], "num_attention_heads=4 is not divisible by parallel.tp=3"),
        (["parallel.tp=1", "parallel.pp=3"], "num_layers=4 is not divisible by pp\\*vpp"),
        (["parallel.tp=1", "parallel.pp=2", "parallel.vpp=4"], "num_layers=4 is not divisible"),
        (["parallel.tp=1", "parallel.ep=2"], "needs an MoE model"),
        (["parallel.sequence_parallel=true", "parallel.tp=1"], "sequence_parallel=true needs"),
        (["parallel.vpp=2", "parallel.tp=1"], "vpp=2 needs parallel.pp > 1"),
        (["checkpoint.keep_last=1"], "keep_last=1"),
        (["train.global_batch_size=7"], "multiple of train.micro_batch_size"),
        (["checkpoint.dump_state_at=[2]"], "dump_state_at needs checkpoint.dump_state_dir"),
        (["checkpoint.dump_state_at=[-1]", "checkpoint.dump_state_dir=/x"], "step numbers"),
    ],
)
def test_impossible_config_is_refused(overrides: list[str], expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        load_config(["recipe=gpt_tiny", *overrides])


def test_moe_expert_count_must_split_over_ep() -> None:
    with pytest.raises(ConfigError, match="ep=3 must divide model.num_experts=4"):
        load_config(["recipe=gpt_tiny_moe", "parallel.ep=3"])


@pytest.mark.parametrize(
    "world, overrides, expected",
    [
        (3, [], "world size 3 is not divisible by tp\\*pp\\*cp"),
        (4, ["parallel.dp=1"], "parallel.dp=1 but tp\\*pp\\*cp\\*dp must equal the world size 4"),
        (4, ["train.global_batch_size=4", "train.micro_batch_size=4"], "multiple of .*= 8"),
    ],
)
def test_world_size_mismatch_is_refused(world: int, overrides: list[str], expected: str) -> None:
    run = load_config(["recipe=gpt_tiny", *overrides])
    with pytest.raises(ConfigError, match=expected):
        validate_runtime(run, world, "cpu")


def test_context_parallel_is_refused_on_cpu_with_reason() -> None:
    run = load_config(["recipe=gpt_tiny", "parallel.tp=1", "parallel.cp=2"])
    with pytest.raises(ConfigError, match="cp=2 needs CUDA.*TEDotProductAttention"):
        validate_runtime(run, 2, "cpu")
    assert validate_runtime(run, 2, "cuda") == 1


def test_cli_rejects_bad_key_before_any_process_group() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pretrain", "recipe=gpt_tiny", "train.stepz=3"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "unknown config key 'train.stepz'" in proc.stderr
    assert "init_process_group" not in proc.stderr


def test_cli_show_config_prints_resolved_yaml() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pretrain", "recipe=llama3_70b", "--show-config"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "num_layers: 80" in proc.stdout and "vpp: 5" in proc.stdout


ELASTIC = [
    "parallel.elastic=true",
    "parallel.tp=1",
    "launch.backend=ft_launcher",
    "launch.nodes=3",
    "launch.min_nodes=1",
]


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["launch.backend=torchrun"], "needs launch.backend=ft_launcher"),
        (["launch.min_nodes=3"], "needs launch.min_nodes below launch.nodes=3"),
        (["checkpoint.optim_format=dp_reshardable"], "bucket layout of the DP size that saved"),
        (["parallel.dp=3"], "parallel.dp=3 must be null"),
        (["checkpoint.resume=false"], "every resize restores"),
        (["launch.slurm.min_nodes=2"], "replaces launch.slurm.min_nodes"),
        (["launch.standby=true"], "launch.standby=true"),
        (["launch.min_nodes=4"], "launch.min_nodes=4 must be between 1 and launch.nodes=3"),
        (["parallel.elastic=false"], "launch.min_nodes=1 is the fewest nodes of an elastic job"),
    ],
)
def test_an_elastic_run_that_cannot_resize_is_refused_with_the_reason(
    overrides: list[str], expected: str
) -> None:
    load_config(["recipe=gpt_tiny", *ELASTIC])  # the base composes
    with pytest.raises(ConfigError, match=expected):
        load_config(["recipe=gpt_tiny", *ELASTIC, *overrides])


def test_an_elastic_layout_must_train_at_every_size_down_to_the_minimum(
    stdlib_corpus: str,
) -> None:
    # gbs 3 / mbs 1 trains on 3 nodes (dp 3) but not on 2 (dp 2): refused before any
    # process starts, by the same check through the CLI (exit 2, one line)
    from launch.common import plan_launch

    sizes = ["launch.nodes=3", "launch.min_nodes=2", "launch.nproc_per_node=1",
             "train.global_batch_size=3", "train.micro_batch_size=1"]  # fmt: skip
    expected = "launch.min_nodes=2: at 2 node(s) x 1 ranks"
    with pytest.raises(ConfigError, match=re.escape(expected)):
        plan_launch(["recipe=gpt_tiny", *ELASTIC, *sizes])
    # the accepted layout goes on to the input checks: it needs a dataset that exists (this
    # test must not depend on `make corpus` having run before it)
    plan_launch(["recipe=gpt_tiny", *ELASTIC, *sizes, "launch.min_nodes=3", "launch.nodes=4",
                 "train.global_batch_size=12", f"data.paths=[{stdlib_corpus}]"])  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "launch", "local", "recipe=gpt_tiny", *ELASTIC, *sizes],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert expected in proc.stderr


@pytest.mark.parametrize("launcher", ["k8s"])
def test_a_launcher_that_cannot_resize_in_a_job_refuses_an_elastic_run(launcher: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "launch", launcher, "--dry-run", "recipe=gpt_tiny", *ELASTIC,
         "launch.nodes=2", "launch.nproc_per_node=1"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"launch {launcher} does not resize inside a job yet" in proc.stderr
