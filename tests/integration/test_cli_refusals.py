"""The public commands as processes: a comma without -m, a list written as a comma, a config
file that does not parse, each refused with one line and process status 2 before anything is
written; and a user's recipe outside the package found with --config-dir."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pretrain.context import exit_codes
from tests.helpers import REPO, USER_RECIPE

# Each entry point as a user types it (`launch slurm` as a dry run: no cluster needed).
ENTRIES = {
    "pretrain": ["pretrain"],
    "launch local": ["launch", "local"],
    "launch slurm": ["launch", "slurm", "--dry-run"],
}


def _cli(args: list[str], tmp: Path | None = None) -> subprocess.CompletedProcess:
    """``tmp``: TMPDIR, where a dry run without --out renders."""
    return subprocess.run(
        [sys.executable, "-m", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1", **({"TMPDIR": str(tmp)} if tmp else {})},
    )


def _refused(proc: subprocess.CompletedProcess) -> str:
    """Process status 2, no traceback, and the one ERROR line."""
    assert proc.returncode == exit_codes.CONFIG_ERROR, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr
    [line] = [ln for ln in proc.stderr.splitlines() if "ERROR" in ln]
    return line


@pytest.mark.parametrize("entry", sorted(ENTRIES))
@pytest.mark.parametrize(
    "value, says",
    [
        ("optimizer.lr=1e-3,3e-3", "a comma makes a sweep; add -m"),
        ("data.paths=a,b", "write data.paths=[a,b] for a list"),
    ],
)
def test_a_comma_without_m_is_refused(entry: str, value: str, says: str, tmp_path: Path) -> None:
    out = tmp_path / "runs"
    proc = _cli([*ENTRIES[entry], "recipe=gpt_tiny", f"output_dir={out}", "run_id=x", value])
    assert says in _refused(proc)
    assert not out.exists()


@pytest.mark.parametrize("entry", sorted(ENTRIES))
def test_a_config_file_that_does_not_parse_is_file_and_line(entry: str, tmp_path: Path) -> None:
    bad = tmp_path / "my.yaml"
    bad.write_text("train:\n  train_steps: [7\n  seed: 1\n")
    line = _refused(_cli([*ENTRIES[entry], "--config", str(bad)]))
    assert f"{bad}:3:7: YAML syntax error" in line


def test_config_dir_adds_a_user_recipe(tmp_path: Path) -> None:
    folder = tmp_path / "conf"
    (folder / "recipe").mkdir(parents=True)
    (folder / "recipe" / "mine.yaml").write_text(USER_RECIPE)
    shown = _cli(["pretrain", "--config-dir", str(folder), "recipe=mine", "--cfg", "job"])
    assert shown.returncode == 0, shown.stderr[-3000:]
    assert yaml.safe_load(shown.stdout)["train"]["train_steps"] == 7
    args = ["--config-dir", str(folder), "recipe=mine", f"output_dir={tmp_path}/runs", "run_id=u"]
    rendered = _cli([*ENTRIES["launch slurm"], *args], tmp=tmp_path)
    assert rendered.returncode == 0, rendered.stderr[-3000:]
    script = Path(rendered.stdout.strip().splitlines()[-1])  # the config is pinned beside it
    pinned = yaml.safe_load((script.parent.parent / "launch-config.yaml").read_text())
    assert pinned["train"]["train_steps"] == 7
