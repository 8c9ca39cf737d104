"""--show-keys and --info tell the truth about a composed recipe: values as the run would get
them, and where each one that no group option sets came from."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers import REPO


def _pretrain(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pretrain", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120)  # fmt: skip


def _row(output: str, key: str) -> str:
    return next(line for line in output.splitlines() if line.strip().startswith(key + " "))


def test_show_keys_shows_the_recipes_values_filtered() -> None:
    proc = _pretrain("--show-keys", "parallel.", "recipe=llama3_70b", "parallel.cp=1")
    assert proc.returncode == 0, proc.stderr
    assert "= 4" in _row(proc.stdout, "parallel.tp") and "= 1" in _row(proc.stdout, "parallel.cp")
    assert all(line.startswith("parallel.") for line in proc.stdout.splitlines())
    defaults = _pretrain("--show-keys", "num_layers")  # no recipe: the schema defaults
    assert defaults.returncode == 0 and "model.num_layers" in defaults.stdout
    none = _pretrain("--show-keys", "no_such_key")
    assert none.returncode == 2 and "no config key contains 'no_such_key'" in none.stderr


def test_info_says_where_each_recipe_value_came_from() -> None:
    proc = _pretrain("recipe=llama3_70b", "parallel.pp=8", "--info")
    assert proc.returncode == 0, proc.stderr
    assert "parallel: single" in proc.stdout  # the group option, as Hydra chose it ...
    assert "(recipe llama3_70b)" in _row(proc.stdout, "parallel.tp")  # ... and what won
    assert "= 8  (override)" in _row(proc.stdout, "parallel.pp")
    assert "(recipe llama3_70b)" in _row(proc.stdout, "launch.nodes")
