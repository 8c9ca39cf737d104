"""Storage that fails under the trainer, from the kernel's file system layer: the run dir on
drill.faultfs (a FUSE passthrough whose calls on chosen paths fail or block), so the trainer's
own reads and fsyncs meet EIO as a failing disk or a stale NFS handle would give it. Which
calls failed is read from the file system's own record (hits.jsonl), not from the trainer.
Skipped, saying why, where /dev/fuse, root or libfuse3 is missing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from pretrain.context import exit_codes
from resiliency.storage.layout import RunLayout
from tests.helpers import REPO, read_steps, run_pretrain

pytestmark = pytest.mark.slow


def _unusable() -> str | None:
    if os.geteuid() != 0:
        return "mounting a FUSE file system here needs root"
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse on this host"
    if shutil.which("fusermount3") is None:
        return "no fusermount3 (apt install fuse3)"
    try:
        import mfusepy  # noqa: F401
    except (ImportError, OSError) as exc:
        return f"mfusepy cannot load libfuse3: {exc}"
    return None


@dataclass
class FaultFS:
    mount: Path
    rules: Path
    hits: Path

    def set(self, *rules: dict) -> None:
        tmp = self.rules.with_suffix(".tmp")
        tmp.write_text(json.dumps(list(rules)))
        tmp.replace(self.rules)

    @property
    def backing(self) -> Path:
        """The directory under the mount: read here, a test never blocks on a hung mount."""
        return self.mount.parent / "backing"

    def landed(self) -> list[dict]:
        if not self.hits.exists():
            return []
        return [json.loads(line) for line in self.hits.read_text().splitlines()]


@pytest.fixture()
def faultfs(tmp_path: Path) -> Iterator[FaultFS]:
    if (why := _unusable()) is not None:
        pytest.skip(why)
    fs = FaultFS(tmp_path / "mnt", tmp_path / "rules.json", tmp_path / "hits.jsonl")
    (tmp_path / "backing").mkdir()
    fs.set()
    proc = subprocess.Popen(
        [sys.executable, "-m", "drill.faultfs", str(tmp_path / "backing"), str(fs.mount),
         "--rules", str(fs.rules), "--hits", str(fs.hits)],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    deadline = time.monotonic() + 30
    while not os.path.ismount(fs.mount):
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        assert time.monotonic() < deadline, "faultfs did not mount"
        time.sleep(0.1)
    try:
        yield fs
    finally:
        fs.set()  # release anything blocked
        subprocess.run(["fusermount3", "-u", "-z", str(fs.mount)], check=False)
        proc.terminate()
        proc.wait(timeout=30)


def _base(tiny: list[str], fs: FaultFS, steps: int) -> list[str]:
    return [*tiny, f"output_dir={fs.mount}", "run_id=run", f"train.train_steps={steps}",
            "checkpoint.save_interval=2", "scheduler.decay_steps=8"]  # fmt: skip


def _torchrun(overrides: list[str]) -> subprocess.CompletedProcess[str]:
    """2 ranks under `python -m launch.torchrun`: its status is the first failing rank's code."""
    return subprocess.run(
        [sys.executable, "-m", "launch.torchrun", "--standalone", "--nproc-per-node=2",
         "-m", "pretrain", *overrides],
        cwd=REPO, text=True, capture_output=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip


def test_a_shard_that_cannot_be_read_makes_the_restore_fall_back_a_step(
    faultfs: FaultFS, tiny_overrides: list[str]
) -> None:
    """Every read of the newest step's model shards fails with EIO (the kernel's answer, to
    the early read, the re-hash and the load alike): the restore names the file, falls back
    to the step before, and the steps it trains again are the ones the first run trained,
    bit for bit."""
    first = run_pretrain(2, _base(tiny_overrides, faultfs, 6))
    assert first.returncode == 0
    layout = RunLayout(faultfs.mount, "run")
    assert layout.published_steps()[-2:] == [4, 6]
    before = {s: r["loss"] for s, r in read_steps(faultfs.mount / "run").items()}
    faultfs.set({"op": "read", "path": "run/steps/step-000000006/model/*", "error": "EIO"})
    again = run_pretrain(2, _base(tiny_overrides, faultfs, 8))
    hits = [h for h in faultfs.landed() if h["error"] == "EIO"]
    assert hits and all(h["op"] == "read" for h in hits), hits
    named = {h["path"].rsplit("/", 1)[-1] for h in hits}
    assert any(name in again.stderr for name in named), again.stderr[-4000:]
    assert "resumed from step-000000004" in again.stderr, again.stderr[-4000:]
    after = {s: r["loss"] for s, r in read_steps(faultfs.mount / "run").items()}
    assert [after[i] for i in (5, 6)] == [before[i] for i in (5, 6)]
    assert layout.published_steps()[-1] == 8


def test_a_save_whose_fsync_fails_publishes_nothing_and_exits_10(
    faultfs: FaultFS, tiny_overrides: list[str]
) -> None:
    """fsync of the step's files returns EIO from the first save on: the save never commits,
    no step is published, and every rank exits 10 (CHECKPOINT_IO, not retried) naming the
    file whose bytes may not be on disk."""
    faultfs.set({"op": "fsync", "path": "run/steps/*", "error": "EIO"})
    proc = _torchrun(_base(tiny_overrides, faultfs, 4))
    assert proc.returncode == exit_codes.CHECKPOINT_IO, proc.stderr[-4000:]
    assert RunLayout(faultfs.mount, "run").published_steps() == []
    fsyncs = [h for h in faultfs.landed() if h["op"] == "fsync"]
    assert fsyncs, faultfs.landed()
    named = {h["path"].rsplit("/", 1)[-1] for h in fsyncs}
    errors = [line for line in proc.stderr.splitlines() if "Input/output error" in line]
    assert any(name in line for line in errors for name in named), errors or proc.stderr[-4000:]


@pytest.mark.parametrize(
    "rule",
    [
        {"op": "readdir", "path": "run/steps/step-000000006/model", "error": "ESTALE"},
        {"op": "getattr", "path": "run/steps/step-000000006/model/*.distcp", "error": "ESTALE"},
    ],
    ids=["listing", "stat"],
)
def test_a_stale_handle_on_the_newest_step_makes_the_restore_fall_back(
    faultfs: FaultFS, tiny_overrides: list[str], rule: dict
) -> None:
    """ESTALE (an NFS server that lost the file handle) on listing the newest step's model dir
    or on stat of its shards: the restore names the step and falls back to the previous one."""
    run_pretrain(2, _base(tiny_overrides, faultfs, 6))
    faultfs.set(rule)
    again = run_pretrain(2, _base(tiny_overrides, faultfs, 8))
    assert any(h["error"] == "ESTALE" for h in faultfs.landed()), faultfs.landed()
    assert "skipped step-000000006" in again.stderr and "ESTALE" in again.stderr, again.stderr[
        -3000:
    ]
    assert "resumed from step-000000004" in again.stderr, again.stderr[-3000:]


def test_a_full_file_system_during_a_save_publishes_nothing_and_exits_10(
    faultfs: FaultFS, tiny_overrides: list[str]
) -> None:
    """ENOSPC on every write into a step being saved (the file system filled up): nothing is
    published and the run exits 10, not retried, saying what the writer could not name."""
    faultfs.set({"op": "write", "path": "run/steps/*", "error": "ENOSPC"})
    proc = _torchrun(_base(tiny_overrides, faultfs, 4))
    assert proc.returncode == exit_codes.CHECKPOINT_IO, proc.stderr[-4000:]
    assert RunLayout(faultfs.mount, "run").published_steps() == []
    assert any(h["error"] == "ENOSPC" for h in faultfs.landed())
    # torch's C++ writer reports no errno ("iostream error"): the message says what it may be
    # and how full the file system is.
    saved = [line for line in proc.stderr.splitlines() if "CheckpointSaveError" in line]
    assert saved and "a full file system or quota" in saved[0], proc.stderr[-4000:]
    assert "Filesystem of" in saved[0] and "MiB free" in saved[0]


SETUP_TIMEOUT_S = 20.0  # the restart restores within it, on a loaded 2-core CI machine too


@pytest.mark.parametrize(
    ("rule", "section", "resumed_from"),
    [
        # the restore's read of the newest step's shards
        ({"op": "read", "path": "run/steps/step-000000006/model/*"}, "setup", 6),
        # the save of step 8: the rank's own fsync of a shard it wrote (a sync save)
        ({"op": "fsync", "path": "run/steps/step-000000008*"}, "checkpointing", 6),
    ],
    ids=["read", "fsync"],
)
def test_a_rank_blocked_on_the_storage_is_named_torn_down_and_the_relaunch_resumes(
    faultfs: FaultFS, tiny_overrides: list[str], rule: dict, section: str, resumed_from: int
) -> None:
    """A call on one file blocks (a hung NFS server's answer to that file): the rank hangs in
    it, the section's timeout catches it, the attempt record names the section and the file the
    rank was blocked on, ft_launcher tears the group down (a process waiting on FUSE dies to
    SIGKILL) and restarts it; the storage answers again and the restart restores the newest
    published step and finishes."""
    first = run_pretrain(2, _base(tiny_overrides, faultfs, 6))
    assert first.returncode == 0
    faultfs.set({**rule, "error": "block"})
    cmd = [sys.executable, "-m", "launch", "local", "--nproc=2", "--max-restarts=1",
           *_base(tiny_overrides, faultfs, 8), "launch.backend=ft_launcher",
           f"resiliency.ft.setup_timeout_s={SETUP_TIMEOUT_S:g}",
           f"resiliency.ft.checkpointing_timeout_s={SETUP_TIMEOUT_S:g}",
           "resiliency.ft.min_io_mb_per_s=1000",
           "resiliency.ft.check_interval_s=0.5", "checkpoint.prefetch=false"]  # fmt: skip
    log = faultfs.mount.parent / "launch.log"
    with log.open("w") as out:
        job = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
        try:
            deadline = time.monotonic() + 120
            while "Worker group FAILED" not in log.read_text(errors="replace"):
                assert job.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
                time.sleep(0.2)
            faultfs.set()  # the storage answers again
            code = job.wait(timeout=180)
        finally:
            faultfs.set()
            if job.poll() is None:
                job.kill()
    text = log.read_text(errors="replace")
    assert code == 0, text[-4000:]
    blocks = [h for h in faultfs.landed() if h["error"] == "block"]
    assert blocks and {h["op"] for h in blocks} == {rule["op"]}, faultfs.landed()
    record = json.loads((faultfs.mount / "run" / "attempts" / "attempt-02.json").read_text())
    causes = json.dumps(record.get("failure") or record)
    blocked = [h["path"].rsplit("/", 1)[-1] for h in blocks]
    assert f"hang in section {section}" in causes, causes[:3000]
    assert f"blocked in {rule['op']}" in causes and any(name in causes for name in blocked), causes[
        :3000
    ]
    assert f"resumed from step-{resumed_from:09d}" in text, text[-4000:]
    assert RunLayout(faultfs.mount, "run").published_steps()[-1] == 8


STORAGE_TIMEOUT_S = 3.0
HUNG = {"op": "*", "path": "*", "error": "block", "unkillable": True}


def _stuck_ranks(mount: Path) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if "pretrain" in cmdline and str(mount) in cmdline:
            found.append(proc)
    return found


def _wait_for(predicate, timeout_s: float, what: str) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def test_a_hard_hung_mount_is_given_up_on_naming_the_stuck_ranks_and_recorded_later(
    faultfs: FaultFS, tiny_overrides: list[str]
) -> None:
    """Every call on the run dir's mount blocks mid-run, and a blocked caller ignores SIGKILL
    (uninterruptible sleep, as on a hung NFS hard mount). ``launch local`` never blocks on the
    run dir itself (its log copy is a child's job): once the rank monitors time out it finds
    the storage silent, SIGKILLs the ranks, names each that outlived it with the call and file
    it is stuck in, and exits 14 while they are still stuck; a relaunch on the still-hung mount
    exits 14 within the probe's timeout, starting nothing. When the storage answers, the
    stuck ranks die, a detached recorder writes the attempt's record with the node's verdict,
    and a relaunch resumes from the newest published step."""
    base = [*_base(tiny_overrides, faultfs, 60), "checkpoint.save_interval=5",
            "launch.backend=ft_launcher", "resiliency.ft.check_interval_s=0.5",
            "resiliency.ft.timeout_floor_s=10", "resiliency.ft.workers_stop_timeout_s=5",
            f"resiliency.health.storage_timeout_s={STORAGE_TIMEOUT_S:g}",
            "checkpoint.prefetch=false"]  # fmt: skip
    cmd = [sys.executable, "-m", "launch", "local", "--nproc=2", "--max-restarts=1", *base]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = faultfs.mount.parent / "launch.log"  # outside the mount
    with log.open("w") as out:
        job = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            _wait_for(lambda: "checkpoint step 20 published" in log.read_text(errors="replace"),
                      120, "no step 20")  # fmt: skip
            faultfs.set(HUNG)
            hung_at = time.monotonic()
            code = job.wait(timeout=120)
            took = time.monotonic() - hung_at
            stuck = [p for p in _stuck_ranks(faultfs.mount) if p.status() == "disk-sleep"]
        finally:
            if job.poll() is None:
                faultfs.set()
                job.kill()
    text = log.read_text(errors="replace")
    assert code == exit_codes.NODE_UNHEALTHY, text[-4000:]
    # The learned step timeout (10 s floor), the probe and the SIGKILL grace, with room.
    assert took < 60, took
    assert stuck, "launch local waited for the stuck ranks to go"
    assert f"small file got no reply in {STORAGE_TIMEOUT_S:g} s" in text, text[-4000:]
    named = [line for line in text.splitlines() if "outlived SIGKILL" in line]
    assert named and all("blocked in " in line and str(faultfs.mount) in line for line in named), (
        text[-4000:]
    )
    assert {int(line.split("rank ")[2].split()[0]) for line in named} <= {0, 1}
    assert "drain it, then resume" in text

    again = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert again.returncode == exit_codes.NODE_UNHEALTHY, again.stderr[-3000:]
    assert "nothing was started" in again.stderr and "Traceback" not in again.stderr

    faultfs.set()  # the storage answers again
    _wait_for(lambda: not any(p.is_running() for p in stuck), 60, "the stuck ranks did not die")
    attempts = faultfs.backing / "run" / "attempts"

    def recorded() -> dict | None:
        for path in sorted(attempts.glob("attempt-*.json")):
            record = json.loads(path.read_text())
            if "node_unhealthy" in record:
                return record
        return None

    _wait_for(lambda: recorded() is not None, 60, "the attempt was never recorded")
    verdict = recorded()["node_unhealthy"]  # type: ignore[index]
    assert "does not answer" in verdict["storage"]
    assert {p["rank"] for p in verdict["unkillable"]} == {
        int(line.split("rank ")[2].split()[0]) for line in named
    }

    resumed = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "resumed from step-0000000" in resumed.stderr
    assert RunLayout(faultfs.mount, "run").published_steps()[-1] == 60
