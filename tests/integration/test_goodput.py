"""The goodput ledger: categories add up to the wall time, lost steps and downtime are counted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from resiliency.monitor.goodput import CATEGORIES, build_ledger
from tests.helpers import REPO, run_pretrain


def _write(run_dir: Path, attempts: list[dict], steps: list[dict], saves: list[dict]) -> None:
    (run_dir / "attempts").mkdir(parents=True)
    (run_dir / "metrics").mkdir()
    for a in attempts:
        (run_dir / "attempts" / f"attempt-{a['attempt']:02d}.json").write_text(json.dumps(a))
    for name, rows in (("steps", steps), ("checkpoints", saves)):
        text = "".join(json.dumps(r) + "\n" for r in rows)
        (run_dir / "metrics" / f"{name}.jsonl").write_text(text)


def test_ledger_by_hand(tmp_path: Path) -> None:
    """Attempt 1 (t=0..10) is killed after step 3 (saved at 2); attempt 2 starts at t=14,
    restores step 2 and redoes step 3: every second is placed, by hand."""
    attempts = [
        {
            "attempt": 1,
            "start_time": 1.0,
            "status": "running",  # killed: ends at its last step
            "startup": {"process_start": 0.0, "first_step_started_at": 4.0},
        },
        {
            "attempt": 2,
            "start_time": 15.0,
            "end_time": 24.0,
            "status": "finished",
            "restored_step": 2,
            "startup": {
                "process_start": 14.0,
                "load_started_at": 16.0,
                "first_step_started_at": 18.0,
            },
        },
    ]
    steps = [
        {"step": 1, "step_time_s": 1.0, "time": 5.0},
        {"step": 2, "step_time_s": 1.0, "time": 6.0},
        {"step": 3, "step_time_s": 2.0, "time": 10.0},  # lost: attempt 2 restored step 2
        {"step": 3, "step_time_s": 2.0, "time": 20.0},
        {"step": 4, "step_time_s": 2.0, "time": 22.5},
    ]
    saves = [
        {"step": 2, "blocked_s": 1.5, "time": 7.5},
        {"step": 4, "blocked_s": 0.5, "time": 23.0},
    ]
    _write(tmp_path, attempts, steps, saves)
    ledger = build_ledger(tmp_path)
    assert ledger.wall_s == 24.0 and ledger.attempts == 2 and ledger.lost_steps == 1
    assert ledger.seconds == {
        "productive": 6.0,  # steps 1, 2 of attempt 1; 3, 4 of attempt 2
        "lost": 2.0,
        "checkpoint_save": 2.0,
        "evaluation": 0.0,
        "startup": 4.0 + 2.0,  # 0->4; 14->16
        "restore": 2.0,  # 16->18
        "downtime": 4.0,  # attempt 1's last step (10) -> attempt 2's process start (14)
        "paused": 0.0,
        "other": (10.0 - 4.0 - 5.5) + (24.0 - 14.0 - 4.0 - 4.5),
    }
    assert sum(ledger.seconds.values()) == pytest.approx(ledger.wall_s)
    assert ledger.goodput == pytest.approx(6.0 / 24.0)


def test_an_attempt_refused_at_config_costs_only_its_own_time(tmp_path: Path) -> None:
    """Attempt 1 (t=0..10) saves step 2 and trains to step 3; attempt 2 (t=12..13) is refused
    at config: restores nothing, trains nothing; attempt 3 (t=15..24) restores step 2. Only
    step 3 of attempt 1 was lost, not all of attempt 1: every second by hand."""
    attempts = [
        {"attempt": 1, "start_time": 0.0, "end_time": 10.0, "status": "failed",
         "startup": {"process_start": 0.0, "first_step_started_at": 4.0}},
        {"attempt": 2, "start_time": 12.0, "end_time": 13.0, "status": "failed",
         "startup": {"process_start": 12.0}},
        {"attempt": 3, "start_time": 15.0, "end_time": 24.0, "status": "finished",
         "restored_step": 2,
         "startup": {"process_start": 15.0, "load_started_at": 16.0,
                     "first_step_started_at": 18.0}},
    ]  # fmt: skip
    steps = [
        {"step": 1, "step_time_s": 1.0, "time": 5.0},
        {"step": 2, "step_time_s": 1.0, "time": 6.0},
        {"step": 3, "step_time_s": 2.0, "time": 9.0},  # lost: attempt 3 restored step 2
        {"step": 3, "step_time_s": 2.0, "time": 20.0},
        {"step": 4, "step_time_s": 2.0, "time": 22.0},
    ]
    _write(tmp_path, attempts, steps, [{"step": 2, "blocked_s": 1.0, "time": 7.0}])
    ledger = build_ledger(tmp_path)
    assert ledger.lost_steps == 1
    assert ledger.seconds["productive"] == 1.0 + 1.0 + 2.0 + 2.0
    assert ledger.seconds["lost"] == 2.0
    assert ledger.seconds["checkpoint_save"] == 1.0
    assert ledger.seconds["startup"] == 4.0 + 1.0 + 1.0  # 0->4; 12->13 (no first step); 15->16
    assert ledger.seconds["restore"] == 2.0  # 16->18
    assert ledger.seconds["downtime"] == 2.0 + 2.0  # 10->12, 13->15
    assert ledger.seconds["other"] == (10 - 4 - 5) + 0.0 + (24 - 15 - 3 - 4)
    assert ledger.wall_s == 24.0 and ledger.goodput == pytest.approx(6.0 / 24.0)


@pytest.mark.slow
def test_the_wait_after_a_ctrl_c_or_a_finished_run_is_a_pause(tmp_path: Path) -> None:
    """Attempt 1 (t=0..10) is stopped by Ctrl-C after step 2 (saved); the user relaunches at
    t=100, attempt 2 restores step 2 and finishes at t=110; at t=200 a third extends the run
    (t=200..210). The two waits are the user's: paused, not downtime, and out of goodput's
    denominator. Every second by hand."""
    attempts = [
        {"attempt": 1, "start_time": 0.0, "end_time": 10.0, "status": "interrupted",
         "startup": {"process_start": 0.0, "first_step_started_at": 4.0}},
        {"attempt": 2, "start_time": 100.0, "end_time": 110.0, "status": "finished",
         "restored_step": 2,
         "startup": {"process_start": 100.0, "load_started_at": 101.0,
                     "first_step_started_at": 102.0}},
        {"attempt": 3, "start_time": 200.0, "end_time": 210.0, "status": "finished",
         "restored_step": 4,
         "startup": {"process_start": 200.0, "load_started_at": 201.0,
                     "first_step_started_at": 202.0}},
    ]  # fmt: skip
    steps = [
        {"step": 1, "step_time_s": 2.0, "time": 6.0},
        {"step": 2, "step_time_s": 2.0, "time": 8.0},
        {"step": 3, "step_time_s": 3.0, "time": 105.0},
        {"step": 4, "step_time_s": 3.0, "time": 108.0},
        {"step": 5, "step_time_s": 4.0, "time": 206.0},
    ]
    _write(tmp_path, attempts, steps, [])
    ledger = build_ledger(tmp_path)
    assert ledger.seconds["paused"] == 90.0 + 90.0  # 10->100, 110->200
    assert ledger.seconds["downtime"] == 0.0 and ledger.lost_steps == 0
    assert ledger.wall_s == 210.0
    assert sum(ledger.seconds.values()) == pytest.approx(ledger.wall_s)
    assert ledger.goodput == pytest.approx((2 + 2 + 3 + 3 + 4) / (210.0 - 180.0))


def test_killed_and_resumed_run(tiny_overrides: list[str], tmp_path: Path) -> None:
    base = [
        *tiny_overrides,
        f"output_dir={tmp_path}",
        "run_id=g",
        "checkpoint.save_interval=4",
        "train.train_steps=8",
    ]
    killed = run_pretrain(2, [*base, "train.fault=kill@6:1"], check=False)
    assert killed.returncode != 0
    run_pretrain(2, base)
    run_dir = tmp_path / "g"
    ledger = build_ledger(run_dir)
    assert all(ledger.seconds[c] >= 0 for c in CATEGORIES if c != "other"), ledger.seconds
    # What was lost, from the raw files: the steps the killed attempt logged after the step
    # the second one restored (4), and their step times.
    steps = [
        json.loads(x) for x in (run_dir / "metrics" / "steps.jsonl").read_text().split("\n") if x
    ]
    records = sorted(
        (json.loads(p.read_text()) for p in (run_dir / "attempts").glob("attempt-*.json")),
        key=lambda r: r["attempt"],
    )
    assert [r["restored_step"] for r in records] == [None, 4]
    resumed_at = records[1]["start_time"]
    lost = [s for s in steps if s["time"] < resumed_at and s["step"] > 4]
    assert ledger.attempts == 2 and ledger.lost_steps == len(lost) >= 1  # step 5 (and 6?)
    assert ledger.seconds["lost"] == pytest.approx(sum(s["step_time_s"] for s in lost))
    kept = [s for s in steps if s not in lost]
    assert ledger.seconds["productive"] == pytest.approx(sum(s["step_time_s"] for s in kept))
    assert ledger.seconds["downtime"] > 0 and ledger.seconds["restore"] > 0
    proc = subprocess.run(
        [sys.executable, "-m", "resiliency", "goodput", str(run_dir), "--json"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["lost_steps"] == ledger.lost_steps
    prom = (run_dir / "metrics" / "metrics.prom").read_text()
    assert 'training_goodput_seconds{category="lost",run_id="g"}' in prom
    assert "training_goodput_ratio" in prom


def test_goodput_cli_refuses_a_non_run_dir(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "resiliency", "goodput", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "is not a run dir" in proc.stdout
