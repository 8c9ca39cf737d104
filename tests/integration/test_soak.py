"""The chaos soak: its fault schedule, its reading of the evidence, the planner's goodput, and
one short soak end to end (python -m drill.soak: faults of every kind in one job under
ft_launcher, the final trajectory bit-exact against a clean run)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from drill.soak.plan import AT_SAVE, IN_PLACE, KINDS, JobShape, PlannedFault, plan_faults
from drill.soak.report import compare, match_faults
from resiliency.cli.capacity import predicted_goodput
from tests.helpers import REPO

SHAPE = JobShape(steps=400, step_s=0.5, save_every=5, nproc=4, learn_after=10)


def test_the_schedule_is_reproducible_and_fits_the_job() -> None:
    faults = plan_faults(random.Random(7), SHAPE, mtbf_s=6.0)
    assert faults == plan_faults(random.Random(7), SHAPE, mtbf_s=6.0)
    assert len(faults) >= 2 * len(KINDS)  # ~ 200 s of training / 6 s
    steps = [f.step for f in faults]
    assert steps == sorted(set(steps)) and 1 <= steps[0] and steps[-1] < SHAPE.steps
    for fault in faults:
        assert fault.step >= SHAPE.earliest(fault.kind) and 0 <= fault.rank < SHAPE.nproc
        assert fault.step % SHAPE.save_every == 0 or fault.kind not in AT_SAVE
        assert fault.rank == 0 or fault.kind != "kill_publish"  # rank 0 alone publishes
    # each deck deals every kind once: the first len(KINDS) faults cover them all
    assert {f.kind for f in faults[: len(KINDS)]} == set(KINDS)
    # the launcher round a fault is limited to counts the restarts before it
    rounds = [sum(g.kind not in IN_PLACE for g in faults[:i]) for i in range(len(faults))]
    assert [f.round for f in faults] == rounds
    assert faults[0].spec() == f"{faults[0].kind}@{faults[0].step}:{faults[0].rank}/0"


def test_gaps_are_exponential_with_the_asked_mean() -> None:
    shape = JobShape(steps=10**6, step_s=0.01, save_every=1, nproc=1, learn_after=0)
    faults = plan_faults(random.Random(3), shape, mtbf_s=2.0, kinds=("kill",))
    gaps = [b.at_s - a.at_s for a, b in zip(faults, faults[1:])]
    mean = sum(gaps) / len(gaps)
    assert len(gaps) > 4000 and abs(mean - 2.0) < 0.1
    assert abs(sorted(gaps)[len(gaps) // 2] - 2.0 * 0.6931) < 0.1  # the median: mean x ln 2


def test_faults_are_matched_to_attempts_and_replays() -> None:
    faults = [
        PlannedFault("kill", 3, 1, 0, 1.0),
        PlannedFault("sdc", 6, 0, 1, 2.0),
        PlannedFault("hang", 8, 0, 1, 3.0),
        PlannedFault("kill_save", 10, 0, 2, 4.0),
    ]
    records = [
        {"status": "failed", "failure_cause": "rank 1 killed", "first_failing_rank": 1,
         "rto": {"detection_s": 0.4, "total_s": 9.0}, "lost_steps": 1},
        {"status": "failed", "failure_cause": "hang in section step (heartbeat)",
         "first_failing_rank": 0, "rto": {"detection_s": 5.0, "total_s": 14.0}, "lost_steps": 3,
         "restored_step": 2,
         "guard": {"events": [{"step": 6, "action": "replay", "anomaly": "non-finite "
                               "gradients", "restored_step": 4}]}},
        {"status": "finished", "restored_step": 4},
    ]  # fmt: skip
    kill, sdc, hang, save = match_faults(faults, records)
    assert (kill.fired, kill.failing_rank, kill.rto_s, kill.restored_step) == (True, 1, 9.0, 2)
    assert (sdc.fired, sdc.restored_step, sdc.lost_steps) == (True, 4, 1)
    assert "replay" in sdc.cause
    assert (hang.detection_s, hang.restored_step) == (5.0, 4)
    assert not save.fired  # attempt 3 finished: that fault never hit


def test_trajectory_comparison_is_exact() -> None:
    clean = {1: 5.0, 2: 4.5, 3: 4.25}
    assert compare(clean, dict(clean), 3) == []
    off = compare(clean, {1: 5.0, 2: 4.5 + 1e-15, 3: 4.25}, 3)
    assert len(off) == 1 and "first 2" in off[0]
    assert "steps without a loss: [3]" in compare(clean, {1: 5.0, 2: 4.5}, 3)[0]


def test_predicted_goodput_is_young_daly() -> None:
    # tau 100 s, save 5 s, restart 60 s, MTBF 3600 s: (1 - 110/3600) / 1.05
    assert predicted_goodput(100.0, 5.0, 60.0, 3600.0) == pytest.approx(0.92328, abs=1e-5)
    assert predicted_goodput(100.0, 0.0, 0.0, 1e12) == pytest.approx(1.0)
    assert predicted_goodput(100.0, 5.0, 600.0, 300.0) == 0.0  # failures outpace recovery


def _orphans() -> set[int]:
    """Helper processes (checkpoint writers) whose rank died under them and that lived on."""
    found = set()
    for proc in psutil.process_iter(["ppid", "cmdline"]):
        if proc.info["ppid"] == 1 and "multiprocessing" in " ".join(proc.info["cmdline"] or []):
            found.add(proc.pid)
    return found


# 96 s of real runs: a soak belongs with the benchmarks (bench P6 runs one), so the default
# run leaves it to `make test-all`; the units above cover its schedule, matching and verdicts.
@pytest.mark.slow
@pytest.mark.exhaustive
def test_a_short_soak_loses_nothing(tmp_path: Path, tiny_overrides: list[str]) -> None:
    out, before = tmp_path / "soak", _orphans()
    cmd = [
        sys.executable, "-m", "drill.soak", f"--out={out}", "--steps=24", "--mtbf-steps=2",
        "--seed=1", *tiny_overrides, "checkpoint.save_interval=4",
        "resiliency.ft.timeout_floor_s=4", "resiliency.ft.learn_after_steps=3",
        "resiliency.ft.check_interval_s=0.5",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    report = json.loads((out / "soak.json").read_text())
    outcomes = report["outcomes"]
    # seed 1: hang, kill_writer, kill_save, corrupt, kill_publish, kill, sdc (one each)
    assert len(outcomes) == 7 and all(o["fired"] for o in outcomes)
    assert {o["spec"].split("@")[0] for o in outcomes} == set(KINDS)
    by_kind = {o["spec"].split("@")[0]: o for o in outcomes}
    assert by_kind["hang"]["failing_rank"] == int(by_kind["hang"]["spec"].split(":")[1][0])
    assert by_kind["corrupt"]["restored_step"] == 12  # step 16 rotted: the one before it
    assert by_kind["sdc"]["restored_step"] == 20 and "replay" in by_kind["sdc"]["cause"]
    assert report["passed"] and "bit-exact" in proc.stdout
    assert 0 < report["goodput"] < 1 and 0 < report["goodput_predicted"] < 1
    assert (out / "soak.md").exists() and (out / "soak.png").stat().st_size > 10_000
    # Six ranks were killed, one as soon as it had started: none left its writer behind.
    assert not _orphans() - before
