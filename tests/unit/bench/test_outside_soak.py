"""P9's grading on a soak's output written by hand: what counts as a fault that happened, a
lost step, a soak that met the goal. The expected rows are worked out here from the inputs."""

from __future__ import annotations

import json
from pathlib import Path

from bench.outside_soak import grade_soak, p9_goal_met

LOG = [
    "soak start\n",
    "E1207 api.py:1002] failed (exitcode: -9) local_rank: 1 (pid: 17872) of binary: python\n",
    "[RankMonServer0@node1:0] Section 'step' has been open for 4.1s\n",
    "Worker group FAILED. 1/3 attempts left\n",
]


def _soak_out(
    tmp_path: Path, planned: int = 3, log: list[str] = LOG, soak_loss: float = 2.5
) -> Path:
    out = tmp_path / "soak"
    (out / "logs").mkdir(parents=True)
    (out / "logs" / "soak.log").write_text("".join(log))
    offsets = [sum(len(line) for line in log[:i]) for i in (1, 2, 3)]
    injected = [
        {"kind": kind, "rank": rank, "log_offset": offset, "confirmed": True}
        for (kind, rank), offset in zip(
            [("sigkill", 1), ("sigstop", 0), ("kill_writer", 1)], offsets
        )
    ]
    report = {"outside": {"plan": [{}] * planned, "injected": injected}}
    (out / "soak.json").write_text(json.dumps(report))
    for name, last in (("clean", 2.5), ("soak", soak_loss)):
        metrics = out / "runs" / name / "soak" / "metrics"
        metrics.mkdir(parents=True)
        lines = [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.9}, {"step": 2, "loss": 2.75}]
        lines.append({"step": 3, "loss": last})
        (metrics / "steps.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"st')
    return out


def test_a_soak_whose_faults_all_show_meets_the_goal(tmp_path: Path) -> None:
    row = grade_soak(_soak_out(tmp_path), 0, None, 3)
    assert row == {
        "steps": 3,
        "planned": 3,
        "faults": 3,
        "kinds": ["kill_writer", "sigkill", "sigstop"],
        "soak_exit": 0,
        "soak_confirmed": 3,
        "kills": 1,
        "kills_in_launcher_log": 1,
        "stops_and_writer_kills": 2,
        "stops_and_writer_kills_in_launcher_log": 2,
        "flips": 0,
        "flips_no_longer_published": 0,
        "full_disks": 0,
        "full_disks_stopped_and_relaunched": 0,
        "outages": 0,
        "remote_newest_step": None,
        "steps_complete": True,
        "bit_exact": True,
    }
    assert p9_goal_met([row])


def test_the_goal_is_missed_by_each_failure_alone(tmp_path: Path) -> None:
    assert not p9_goal_met([])
    assert not p9_goal_met([grade_soak(_soak_out(tmp_path / "a"), 1, None, 3)])  # soak's exit
    assert not p9_goal_met([grade_soak(_soak_out(tmp_path / "b", planned=4), 0, None, 3)])
    no_stop = [("nothing here\n" if "RankMonServer" in line else line) for line in LOG]
    row = grade_soak(_soak_out(tmp_path / "c", log=no_stop), 0, None, 3)
    assert row["stops_and_writer_kills_in_launcher_log"] == 1 and not p9_goal_met([row])
    other_rank = [line.replace("local_rank: 1", "local_rank: 0") for line in LOG]
    row = grade_soak(_soak_out(tmp_path / "d", log=other_rank), 0, None, 3)
    assert row["kills_in_launcher_log"] == 0 and not p9_goal_met([row])
    row = grade_soak(_soak_out(tmp_path / "e", soak_loss=2.5000001), 0, None, 3)
    assert not row["bit_exact"] and not p9_goal_met([row])
    assert not grade_soak(_soak_out(tmp_path / "f"), 0, None, 4)["steps_complete"]
