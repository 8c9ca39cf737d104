"""Ctrl-C from outside, as a terminal sends it: the ranks make the emergency save, the process
ends 130 with the command that resumes as its last line, and that command resumes bit-exactly.

SIGINT goes to the launch's whole process group (what a terminal's Ctrl-C does) or to the
launcher's pid alone (``kill -INT``), at a step drawn at random (the seed is printed); the
reference is an uninterrupted run of the same config, compared step by step (loss, grad norm
and the samples' hash, bit for bit). A second Ctrl-C stops at once, without a save.
"""

from __future__ import annotations

import json
import os
import random
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from pretrain.context import exit_codes
from resiliency.storage.layout import RunLayout
from tests.ft_helpers import env, launch_cmd
from tests.helpers import REPO, read_steps

STEPS, SAVE_EVERY = 14, 5
SEED = int(os.environ.get("INTERRUPT_SEED", time.time_ns() % 10_000))


def _overrides(tiny: list[str], root: Path, run_id: str) -> list[str]:
    return [
        *tiny,
        f"output_dir={root}",
        f"run_id={run_id}",
        f"train.train_steps={STEPS}",
        f"checkpoint.save_interval={SAVE_EVERY}",
        "checkpoint.fingerprint=true",  # the restore re-checks every tensor it saved
    ]


@pytest.fixture(scope="module")
def reference(stdlib_corpus: str, tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict]:
    """An uninterrupted run's steps (shared by every test here)."""
    tiny = _tiny(stdlib_corpus)
    root = tmp_path_factory.mktemp("reference")
    proc = subprocess.run(launch_cmd(_overrides(tiny, root, "ref")), cwd=REPO, env=env(),
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return read_steps(root / "ref")


def _tiny(corpus: str) -> list[str]:
    return ["recipe=gpt_tiny", f"data.paths=[{corpus}]", "train.micro_batch_size=2",
            "train.global_batch_size=8"]  # fmt: skip


def _start(cmd: Sequence[str], log: Path) -> subprocess.Popen:
    with log.open("w") as out:  # its own session: the group a terminal would signal
        return subprocess.Popen(cmd, cwd=REPO, env=env(), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip


def _wait_for_step(proc: subprocess.Popen, run_dir: Path, step: int, timeout: float = 240) -> None:
    steps = run_dir / "metrics" / "steps.jsonl"
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, f"ended before step {step} (exit {proc.returncode})"
        if steps.exists() and len(steps.read_text().splitlines()) >= step:
            return
        time.sleep(0.05)
    raise AssertionError(f"step {step} not reached in {timeout} s")


def _attempt(run_dir: Path) -> dict:
    paths = sorted((run_dir / "attempts").glob("attempt-*.json"))
    return json.loads(paths[-1].read_text())


def _assert_same_steps(got: dict[int, dict], want: dict[int, dict]) -> None:
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    for step, record in want.items():
        for key in ("loss", "grad_norm", "sample_hash"):
            assert got[step][key] == record[key], (step, key, got[step][key], record[key])


def _interrupt_and_check(proc: subprocess.Popen, log: Path, run_dir: Path, group: bool) -> int:
    """SIGINT at a random step; the emergency save, exit 130, no traceback: the stop step."""
    at = random.Random(SEED).randint(2, STEPS - 4)
    print(f"INTERRUPT_SEED={SEED}: SIGINT after step {at}")
    _wait_for_step(proc, run_dir, at)
    os.killpg(proc.pid, signal.SIGINT) if group else proc.send_signal(signal.SIGINT)
    code = proc.wait(timeout=120)
    out = log.read_text()
    assert code == exit_codes.INTERRUPTED, out[-4000:]
    assert "Traceback" not in out and "Logging error" not in out, out[-6000:]
    record = _attempt(run_dir)
    assert (record["status"], record["exit_code"]) == ("interrupted", exit_codes.INTERRUPTED)
    stopped = record["step"]
    assert at <= stopped < STEPS
    assert RunLayout.from_run_dir(run_dir).published_steps()[-1] == stopped, "emergency save"
    return stopped


@pytest.mark.slow
def test_ctrl_c_under_launch_local_saves_and_the_printed_command_resumes_exactly(
    stdlib_corpus: str, reference: dict[int, dict], tmp_path: Path
) -> None:
    overrides = _overrides(_tiny(stdlib_corpus), tmp_path, "run")
    log = tmp_path / "first.log"
    proc = _start(launch_cmd(overrides), log)
    _interrupt_and_check(proc, log, tmp_path / "run", group=True)
    last = log.read_text().strip().splitlines()[-1]
    assert "resume with: " in last, last
    resume = shlex.split(last.split("resume with: ", 1)[1])
    assert "--nproc=2" not in resume and "launch.nproc_per_node=2" in resume
    done = subprocess.run(resume, cwd=REPO, env=env(), capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    assert "interrupted" not in _attempt(tmp_path / "run")["status"]
    _assert_same_steps(read_steps(tmp_path / "run"), reference)
    # Not a failure: no retry was spent and goodput's ledger shows two planned ends.
    ls = subprocess.run([sys.executable, "-m", "resiliency", "ls", str(tmp_path / "run")],
                        cwd=REPO, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert ls.returncode == 0 and "interrupted" in ls.stdout and "failed" not in ls.stdout


@pytest.mark.slow
def test_ctrl_c_with_an_async_save_in_flight_under_launch_torchrun(
    stdlib_corpus: str, reference: dict[int, dict], tmp_path: Path
) -> None:
    """kill -INT of the launcher's pid alone; a save every step, async: one is in flight."""
    overrides = [*_overrides(_tiny(stdlib_corpus), tmp_path, "run"),
                 "checkpoint.async_save=true", "checkpoint.save_interval=1"]  # fmt: skip
    cmd = [sys.executable, "-m", "launch.torchrun", "--standalone", "--nproc-per-node=2",
           "-m", "pretrain", *overrides]  # fmt: skip
    log = tmp_path / "first.log"
    _interrupt_and_check(_start(cmd, log), log, tmp_path / "run", group=False)
    again = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True,
                           timeout=300)  # fmt: skip
    assert again.returncode == 0, again.stderr[-4000:]
    _assert_same_steps(read_steps(tmp_path / "run"), reference)


@pytest.mark.slow
def test_a_second_ctrl_c_stops_at_once_without_a_save(stdlib_corpus: str, tmp_path: Path) -> None:
    # Rank 0's steps take ~40x longer from step 3: the first Ctrl-C waits for the step in
    # flight, and the second one, 2 s later, must not.
    overrides = [*_overrides(_tiny(stdlib_corpus), tmp_path, "run"), "launch.backend=ft_launcher",
                 "checkpoint.save_interval=2", "train.fault=slow@3:0:40"]  # fmt: skip
    log = tmp_path / "run.log"
    proc = _start(launch_cmd(overrides), log)
    _wait_for_step(proc, tmp_path / "run", 2)
    layout = RunLayout(tmp_path, "run")
    while layout.published_steps() != [2]:  # the step-2 save, then the slow step 3
        assert proc.poll() is None, log.read_text()[-4000:]
        time.sleep(0.05)
    time.sleep(1.0)
    os.killpg(proc.pid, signal.SIGINT)
    time.sleep(2.0)  # past launch local's SECOND_PRESS_S
    os.killpg(proc.pid, signal.SIGINT)
    started = time.monotonic()
    code = proc.wait(timeout=60)
    out = log.read_text()
    assert code == exit_codes.INTERRUPTED, out[-4000:]
    assert time.monotonic() - started < 20, "a second Ctrl-C stops at once"
    assert "second Ctrl-C: stopping" in out and "Traceback" not in out, out[-6000:]
    assert layout.published_steps() == [2], "no save after it"
    record = _attempt(tmp_path / "run")  # the ranks could not say it: the launcher did
    assert (record["status"], record["exit_code"]) == ("interrupted", exit_codes.INTERRUPTED)
    assert "resume with: " in out.strip().splitlines()[-1]
