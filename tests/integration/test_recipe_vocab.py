"""The vocabulary of every shipped recipe is in the recipe (``data.vocab_size``), so planning a
cluster run needs no tokenizer files here, and a run refuses a tokenizer of another size."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pretrain.context import exit_codes
from recipes import list_recipes, load_config
from tests.ft_helpers import env
from tests.helpers import REPO


@pytest.mark.parametrize("recipe", list_recipes())
def test_every_recipe_knows_its_vocabulary(recipe: str) -> None:
    run = load_config([f"recipe={recipe}"])
    data, model = run.data, run.model
    known = data.tokenizer == "byte" or model.padded_vocab_size is not None
    assert known or data.vocab_size is not None, f"{recipe}: set data.vocab_size"


def test_plan_needs_no_vocab_flag() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pretrain", "recipe=llama3_70b", "--plan", "--gpu", "h100-80gb"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "fits: yes" in proc.stdout


@pytest.mark.slow
def test_a_tokenizer_of_another_size_is_refused(tiny_overrides: list[str], tmp_path: Path) -> None:
    overrides = [*tiny_overrides, f"output_dir={tmp_path}", "data.vocab_size=1000",
                 "parallel.tp=1", "checkpoint.enabled=false"]  # fmt: skip
    proc = subprocess.run(  # launch.torchrun: exits with the failing rank's code
        [sys.executable, "-m", "launch.torchrun", "--standalone", "--nproc-per-node=1",
         "-m", "pretrain", *overrides],
        cwd=REPO, capture_output=True, text=True, timeout=300, env=env(),
    )  # fmt: skip
    assert proc.returncode == exit_codes.CONFIG_ERROR, proc.stderr[-2000:]
    assert "data.vocab_size=1000, but the tokenizer (byte) has 258 ids" in proc.stderr  # 256 + 2
