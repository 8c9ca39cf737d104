"""One writer, provably: a job stopped past its lease is fenced when it wakes; an I/O error in
the restore's re-hash falls back to the previous step on every rank (real runs, real signals).

The stopped job is frozen from outside (SIGSTOP to its whole process group, at a moment the test
draws, not one the trainer chooses) and the second job runs in its own pid namespace, as a job on
another host would: nothing there can prove the first one dead, only its silent heartbeat.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from pretrain.context import exit_codes
from resiliency.storage.layout import RunLayout
from resiliency.storage.lease import read_lease
from resiliency.storage.manifest import read_manifest
from resiliency.storage.verify import verify_step_dir
from tests.ft_helpers import env
from tests.helpers import REPO, read_steps

RUN = "fenced"
STEPS = 36
LEASE_TIMEOUT_S = 3


def _can_unshare() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], check=False)
    return probe.returncode == 0


def _job(overrides: list[str], log: Path, namespace: bool = False) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "launch.torchrun", "--standalone", "--nproc-per-node=2"]
    cmd += ["-m", "pretrain", *overrides]
    if namespace:  # its own pid namespace: as on another host, our pids mean nothing to it
        cmd = ["unshare", "--pid", "--fork", "--mount-proc", *cmd]
    with log.open("w") as out:
        return subprocess.Popen(
            cmd, cwd=REPO, env=env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def _wait_for(what: str, ready: object, timeout: float, *jobs: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while not ready():  # type: ignore[operator]
        for job in jobs:
            assert job.poll() is None, f"a job exited ({job.returncode}) before {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _signal_tree(pid: int, sig: signal.Signals) -> None:
    """Signal a job's every process: torchrun puts its workers in sessions of their own, so
    the launcher's process group alone would leave them running."""
    root = psutil.Process(pid)
    for proc in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.send_signal(sig)


def _published(layout: RunLayout) -> dict[int, int]:
    """Published step -> the attempt whose manifest it is."""
    return {s: read_manifest(layout.step_dir(s)).attempt for s in layout.published_steps()}


@pytest.mark.slow
@pytest.mark.skipif(not _can_unshare(), reason="needs root and unshare --pid (CI has both)")
def test_a_job_stopped_past_its_lease_writes_nothing_after_the_takeover(
    tiny_overrides: list[str], tmp_path: Path
) -> None:
    seed = random.randrange(2**31)
    print(f"seed {seed}")
    rng = random.Random(seed)
    root = tmp_path / "runs"
    layout = RunLayout(root, RUN)
    common = [
        *tiny_overrides,
        f"output_dir={root}",
        f"run_id={RUN}",
        f"train.train_steps={STEPS}",
        "checkpoint.save_interval=2",
        f"checkpoint.lease_timeout_s={LEASE_TIMEOUT_S}",
    ]
    first = _job(common, tmp_path / "first.log")
    second: subprocess.Popen | None = None
    try:
        _wait_for("two published steps", lambda: len(layout.published_steps()) >= 2, 240, first)
        time.sleep(rng.uniform(0.0, 1.5))  # a moment the trainer does not choose
        _signal_tree(first.pid, signal.SIGSTOP)  # the whole job freezes: a stalled node
        before = _published(layout)

        second = _job(common, tmp_path / "second.log", namespace=True)
        _wait_for("the takeover", lambda: _lease_attempt(layout) == 2, 120, second)
        _wait_for("a step of the new owner", lambda: 2 in _published(layout).values(), 120, second)

        first_log_at = (tmp_path / "first.log").stat().st_size
        _signal_tree(first.pid, signal.SIGCONT)  # the stale owner wakes beside the new one
        assert first.wait(timeout=120) == exit_codes.LEASE_HELD
        assert second.wait(timeout=300) == 0, (tmp_path / "second.log").read_text()[-4000:]
    finally:
        for job in (first, second):
            if job is not None and job.poll() is None:
                _signal_tree(job.pid, signal.SIGCONT)
                _signal_tree(job.pid, signal.SIGKILL)
                job.wait()

    woken = (tmp_path / "first.log").read_text()[first_log_at:]
    assert "now held by attempt 2" in woken, woken[-3000:]
    assert "published" not in woken and "retention: removed" not in woken, woken[-3000:]
    after = _published(layout)
    # The first job published nothing after the takeover: every step of attempt 1 left is one
    # that existed when it froze (the new owner's retention may have removed some of them).
    assert {s for s, a in after.items() if a == 1} <= set(before)
    assert max(after) == STEPS and after[STEPS] == 2
    assert json.loads(layout.latest_path.read_text())["step"] == STEPS
    for step in after:
        verdict = verify_step_dir(layout.step_dir(step), RUN, full=True)
        assert verdict.ok, verdict.reason
    records = {
        json.loads(p.read_text())["attempt"]: json.loads(p.read_text())
        for p in layout.attempts_dir.glob("attempt-*.json")
    }
    # The new owner resumed from the newest step the first had published (a step the frozen
    # job's rank 0 published as the signals reached it counts too), and finished.
    assert (records[2].get("restored_step") or 0) >= max(before), (records[2], before)
    assert read_steps(layout.run_dir)[STEPS]
    assert records[1]["status"] == "fenced" or records[1].get("failure_class") == "lease"
    assert records[2]["lease_generation"] > records[1]["lease_generation"]


def _lease_attempt(layout: RunLayout) -> int | None:
    try:
        info = read_lease(layout)
    except ValueError:
        return None
    return info.attempt if info is not None else None


@pytest.mark.slow
def test_an_io_error_in_one_ranks_rehash_falls_back_on_every_rank(
    tiny_overrides: list[str], tmp_path: Path
) -> None:
    """EIO on rank 1 while it re-hashes its share of the newest step: every rank learns it in
    the collective that confirms the plan, and the previous step is restored (no hang)."""
    root = tmp_path / "runs"
    base = [*tiny_overrides, f"output_dir={root}", "run_id=eio", "checkpoint.save_interval=2"]
    run = [sys.executable, "-m", "launch.torchrun", "--standalone", "--nproc-per-node=2"]
    first = subprocess.run(
        [*run, "-m", "pretrain", *base, "train.train_steps=4"],
        cwd=REPO, env=env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert first.returncode == 0, first.stderr[-3000:]
    again = subprocess.run(
        [*run, "-m", "pretrain", *base, "train.train_steps=6", "train.fault=eio_rehash@4:1",
         "checkpoint.schedule_on_resume=checkpoint"],
        cwd=REPO, env=env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr[-4000:]
    assert "step 4 failed its re-hash (rank 1: I/O error" in again.stderr
    assert "EIO" in again.stderr
    record = json.loads((root / "eio" / "attempts" / "attempt-02.json").read_text())
    assert record["restored_step"] == 2
    layout = RunLayout(root, "eio")
    assert layout.published_steps()[-1] == 6
    assert verify_step_dir(layout.step_dir(4), "eio", full=True).ok  # saved anew by attempt 2
