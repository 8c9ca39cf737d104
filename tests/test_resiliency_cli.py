"""``python -m resiliency`` ls / verify / gc, run as real subprocesses."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from resiliency.storage.layout import RunLayout
from resiliency.storage.lease import RunLease
from resiliency.storage.publish import begin_step, update_latest
from resiliency.storage.synthetic import write_synthetic_step

REPO = Path(__file__).resolve().parents[1]
RUN = "run-cli-001"
SHARD = "model/__0_0.distcp"


def cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "resiliency", *map(str, args)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture
def layout(tmp_path: Path) -> RunLayout:
    lo = RunLayout(tmp_path / "ckpt", RUN)
    for step in (100, 200, 300, 400):
        write_synthetic_step(lo, step, attempt=1)
    return lo


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[50] ^= 0x01
    path.write_bytes(bytes(data))


def test_help_lists_subcommands() -> None:
    out = cli("--help")
    assert out.returncode == 0
    for name in ("ls", "verify", "gc"):
        assert name in out.stdout


def test_ls(layout: RunLayout) -> None:
    (layout.step_dir(400) / "COMMITTED").unlink()
    update_latest(layout, 300)
    begin_step(layout, 500, 2)
    out = cli("ls", layout.run_dir)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert any("latest.json: step 300" in ln for ln in lines)
    row = {ln.split()[1]: ln for ln in lines if ln.strip().split()[0].isdigit()}
    assert set(row) == {
        "step-000000100",
        "step-000000200",
        "step-000000300",
        "step-000000400",
        "step-000000500.tmp-attempt-02",
    }
    assert "yes" in row["step-000000300"] and row["step-000000300"].endswith("latest")
    assert " no " in row["step-000000400"] and "no COMMITTED" in row["step-000000400"]
    assert "tmp of attempt 02" in row["step-000000500.tmp-attempt-02"]


def test_ls_says_what_it_checked_and_verify_rehashes(layout: RunLayout) -> None:
    """A flipped byte keeps every size: plain ls must not call the step verified; --verify
    re-hashes, marks it BAD with the reason and exits 1."""
    flip_byte(layout.step_dir(300) / SHARD)
    quick = cli("ls", layout.run_dir)
    assert quick.returncode == 0 and "sizes and markers only" in quick.stdout
    assert "VERIFIED" not in quick.stdout
    row = next(ln for ln in quick.stdout.splitlines() if "step-000000300" in ln)
    assert "sizes ok" in row
    full = cli("ls", layout.run_dir, "--verify")
    assert full.returncode == 1, full.stdout
    rows = {ln.split()[1]: ln for ln in full.stdout.splitlines() if ln.split()[0].isdigit()}
    assert "BAD" in rows["step-000000300"] and "crc32c mismatch" in rows["step-000000300"]
    assert "crc ok" in rows["step-000000400"]
    assert "verifying step-000000300 (2/4)" in full.stderr


def test_ls_missing_dir(tmp_path: Path) -> None:
    out = cli("ls", tmp_path / "nope")
    assert out.returncode == 2 and "not a directory" in out.stdout


def test_verify_ok_and_bad(layout: RunLayout) -> None:
    good = cli("verify", layout.step_dir(400))
    assert good.returncode == 0 and good.stdout.startswith("OK") and "full" in good.stdout
    flip_byte(layout.step_dir(400) / SHARD)
    quick = cli("verify", layout.step_dir(400), "--quick")
    assert quick.returncode == 0 and "quick" in quick.stdout
    bad = cli("verify", layout.step_dir(400))
    assert bad.returncode == 1 and bad.stdout.startswith("BAD") and "mismatch" in bad.stdout
    other = cli("verify", layout.step_dir(300), "--run-id", "another-run")
    assert other.returncode == 1 and "another run" in other.stdout
    missing = cli("verify", layout.step_dir(999))
    assert missing.returncode == 1 and "does not exist" in missing.stdout


def test_gc_dry_run_then_apply(layout: RunLayout) -> None:
    dead_tmp = begin_step(layout, 500, 2)
    dry = cli("gc", layout.run_dir, "--dry-run", "--keep-last", "2")
    assert dry.returncode == 0, dry.stderr
    assert "would delete  step-000000100" in dry.stdout and "dry run: 3 dir(s)" in dry.stdout
    assert layout.published_steps() == [100, 200, 300, 400] and dead_tmp.exists()
    real = cli("gc", layout.run_dir, "--keep-last", "2", "--milestone-interval", "200")
    assert real.returncode == 0, real.stderr
    assert "deleted 2 dir(s)" in real.stdout
    assert layout.published_steps() == [200, 300, 400] and not dead_tmp.exists()


def test_gc_rejects_bad_keep_last(layout: RunLayout) -> None:
    out = cli("gc", layout.run_dir, "--keep-last", "1")
    assert out.returncode == 2 and "keep_last must be >= 2" in out.stdout
    assert layout.published_steps() == [100, 200, 300, 400]


def test_gc_refuses_live_run(layout: RunLayout) -> None:
    live_tmp = begin_step(layout, 500, 7)
    with RunLease(layout, attempt=7, timeout_s=60):
        out = cli("gc", layout.run_dir, "--keep-last", "2")
        assert out.returncode == 2 and "run is live" in out.stdout
        dry = cli("gc", layout.run_dir, "--keep-last", "2", "--dry-run")
        assert dry.returncode == 0 and "[live]" in dry.stdout
        assert "tmp dir of live attempt 7" in dry.stdout
    assert layout.published_steps() == [100, 200, 300, 400] and live_tmp.exists()
