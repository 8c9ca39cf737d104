"""``python -m resiliency ls <output_dir>`` lists the runs under it instead of reading the root as
one empty run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from resiliency.storage.attempts import write_attempt_record
from resiliency.storage.layout import RunLayout
from resiliency.storage.synthetic import write_synthetic_step
from tests.helpers import REPO


def _ls(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "resiliency", "ls", str(path)], cwd=REPO,
                          capture_output=True, text=True, timeout=60)  # fmt: skip


def test_an_output_dir_lists_its_runs(tmp_path: Path) -> None:
    done, killed = RunLayout(tmp_path, "lr-0"), RunLayout(tmp_path, "lr-1")
    for step in (5, 10):
        write_synthetic_step(done, step)
    write_attempt_record(done, 1, {"status": "finished", "start_time": 1.0})
    write_synthetic_step(killed, 5)
    write_attempt_record(killed, 1, {"status": "running", "start_time": 1.0})  # no lease: died
    (tmp_path / "not-a-run").mkdir()
    proc = _ls(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {line.split()[0]: line.split() for line in proc.stdout.splitlines()[2:]}
    assert sorted(rows) == ["lr-0", "lr-1"]
    assert rows["lr-0"][1:4] == ["10", "finished", "1"]
    assert rows["lr-1"][1:4] == ["5", "died", "1"]
    one = _ls(done.run_dir)  # a run dir is still listed as itself
    assert one.returncode == 0 and "run_id lr-0" in one.stdout
