"""The console scripts of pyproject.toml's [project.scripts], run as installed processes:
mcore-pretrain, mcore-launch and mcore-ckpt are `python -m pretrain|launch|resiliency`, exit
codes included, and their --help texts read as plain text (no reStructuredText markup)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.helpers import REPO

BIN = Path(sys.executable).parent
SCRIPTS = {"mcore-pretrain": "pretrain", "mcore-launch": "launch", "mcore-ckpt": "resiliency"}
# What a docstring written for Sphinx shows in a terminal: ``literal`` and :role:`target`.
RST = re.compile(r"``|:(mod|class|func|meth|attr|ref|doc):`")
HELP = [
    ["mcore-pretrain", "--help"],
    ["mcore-launch", "--help"],
    ["mcore-launch", "local", "--help"],
    ["mcore-launch", "slurm", "--help"],
    ["mcore-launch", "k8s", "--help"],
    ["mcore-ckpt", "--help"],
    ["mcore-ckpt", "ls", "--help"],
    ["mcore-ckpt", "verify", "--help"],
    ["mcore-ckpt", "gc", "--help"],
]


def script(name: str, *args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    path = BIN / name
    if not path.exists():
        pytest.fail(f"{path} is not installed: run {BIN / 'pip'} install --no-deps -e .")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [str(path), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def test_pyproject_declares_the_scripts() -> None:
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {name: f"{module}.__main__:cli" for name, module in SCRIPTS.items()}


@pytest.mark.parametrize("argv", HELP, ids=" ".join)
def test_help_runs_and_reads_as_plain_text(argv: list[str]) -> None:
    proc = script(*argv)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip(), proc.stderr[-3000:]
    markup = [line for line in proc.stdout.splitlines() if RST.search(line)]
    assert not markup, markup


def test_the_scripts_exit_with_the_documented_codes(tmp_path: Path) -> None:
    """2 for a config or usage error, as `python -m` exits: the code reaches the shell."""
    recipe = script("mcore-pretrain", "recipe=no_such_recipe", f"output_dir={tmp_path}")
    assert recipe.returncode == 2 and "unknown recipe 'no_such_recipe'" in recipe.stderr
    flag = script("mcore-launch", "local", "--no-such-flag")
    assert flag.returncode == 2 and "unknown option '--no-such-flag'" in flag.stderr
    run = script("mcore-ckpt", "ls", "no-such-run", cwd=tmp_path)
    assert run.returncode == 2 and "no-such-run is neither a path nor a run id" in run.stdout
    soak = script("mcore-ckpt", "soak")
    assert soak.returncode == 2 and "python -m drill.soak" in soak.stderr
