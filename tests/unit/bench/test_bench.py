"""The benchmark command's table is well formed (no timing is asserted: benchmarks are no tests)."""

from __future__ import annotations

import subprocess
import sys

from bench.__main__ import REPO, stats
from bench.table import table


def _s(*values: float) -> dict:
    return stats(list(values))


def test_table_has_one_well_formed_row_per_figure():
    save = {
        "bytes": 1 << 30,
        "P1": _s(0.5, 0.4, 0.6),
        "raw_write_GiBps": _s(1.0),
        "save_GiBps": _s(0.5),
        "P2_blocked_over_memcpy": _s(10.0),
        "P2_blocked_s": _s(1.0),
        "P2_memcpy_s": _s(0.1),
        "P2_save_call_s": _s(0.9),
        "P2_commit_s": _s(0.1),
        "P2_goal_met": False,
        "P2_first_blocked_s": 0.2,
        "P2_first_blocked_over_memcpy": 2.0,
        "P2_first_goal_met": True,
        "P2_step_slowdown": None,
        "P2_busy_steps": 0,
    }
    restore = {
        "bytes": 1 << 30,
        "P3": _s(1.0),
        "resumed_s": _s(4.0),
        "first_step_s": _s(5.0),
        "fresh_s": _s(3.0),
        "read_GiBps": _s(1.0),
        "P3_pairs": 3,
        "P3_added_s": _s(1.0),
        "added_by_phase_s": {"start_s": 0.3, "plan_and_build_s": -0.4},
        "P3_goal_met": True,
    }
    results = {
        "save": {"tiny": save},
        "restore": {"tiny": restore},
        "hang": {
            "sections": {
                name: {
                    "section": section,
                    "timeout_s": 4.0,
                    "detection_s": 5.1,
                    "goal_s": 9.0,
                    "goal_met": True,
                    "named_right": "1/1",
                    "rules": ["heartbeat"],
                }
                for name, section in (("step", "step"), ("restore", "setup"))
            },
            "random": {
                "named_right": 10,
                "stops": 10,
                "undetermined": 0,
                "sections": {"step": 7, "checkpointing": 3},
            },
        },
        "overhead": {
            "tiny": {
                "P5": _s(1.0),
                "P5_without_reporting": _s(1.0),
                "reporting_share": _s(1.0),
                "bare_step_s": _s(0.1),
                "framework_step_s": _s(0.1),
                "shim_calls_per_step": 10,
                "hooks_ms_per_step": {"PreemptionHook.before_step": 1.0},
                "shim_s_per_step": 0.001,
                "shim_fraction_of_bare_step": 0.01,
            }
        },
        "soak": {
            "P6": 0.97,
            "goodput": 0.9,
            "goodput_predicted": 0.93,
            "faults": 3,
            "kinds": ["hang", "kill"],
            "passed": True,
            "problems": [],
            "wall_s": {"clean": 600.0, "soak": 660.0},
            "mtbf_s": 200.0,
        },
    }
    lines = table(results).strip().splitlines()
    assert len(lines) == 2 + 10
    assert all(
        line.startswith("|") and line.endswith("|") and len(line.split("|")) == 10 for line in lines
    )
    figures = [line.split(" | ")[0][2:4] for line in lines[2:]]
    assert figures == ["P1", "P2", "P2", "P2", "P3", "P4", "P4", "P4", "P5", "P6"]
    assert "(restore − fresh by phase: start +0.30 s, plan_and_build -0.40 s)" in lines[6]
    assert (
        "| P6 soak goodput" in lines[-1] and "| 0.970 |" in lines[-1] and "bit-exact" in lines[-1]
    )


def test_bench_command_parses_its_options():
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--help"],
        cwd=REPO,
        text=True,
        capture_output=True,
        timeout=60,
    )
    assert proc.returncode == 0 and "--full" in proc.stdout
