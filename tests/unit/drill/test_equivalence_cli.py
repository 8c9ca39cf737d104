"""``python -m drill.equivalence`` refuses what it cannot do, in one line and exit 2, before
any run starts and without touching --out."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from drill.equivalence.cli import main


@pytest.fixture(autouse=True)
def keep_sigterm() -> object:
    """main() installs its SIGTERM handler in this process: put the test runner's back, so a
    process this worker forks later does not inherit it."""
    before = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, before)


@pytest.mark.parametrize(
    "args, expected",
    [
        (["train.fault=kill@3"], "the gate sets train.fault itself"),
        (["run_id=x", "output_dir=/tmp/y"], "the gate sets output_dir, run_id itself"),
        (["--step", "0"], "the restored step must be >= 1"),
        (["--resume-nproc", "0"], "--nproc and --resume-nproc must be >= 1"),
        (["recipe=gpt_tny"], "bad recipe overrides"),
        (["recipe=gpt_tiny", "train.micro_batch_sise=2"], "bad recipe overrides"),
    ],
)
def test_bad_arguments_exit_2_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], expected: str
) -> None:
    out = tmp_path / "gate"
    assert main(["--out", str(out), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0], err
    assert not out.exists()


def test_a_used_output_dir_is_refused_and_left_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "keep.txt").write_text("mine")
    assert main(["--out", str(tmp_path), "recipe=gpt_tiny"]) == 2
    assert "is not empty: give a new directory" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]
