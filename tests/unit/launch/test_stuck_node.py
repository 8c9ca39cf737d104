"""What launch local says when it gives a node up, and which failure it judges."""

from __future__ import annotations

from pathlib import Path

from launch.stuck_node import NodeVerdict, StuckWatch
from resiliency.monitor.postmortem import LauncherEvents


def _watch(events: LauncherEvents) -> StuckWatch:
    return StuckWatch(
        run_dir=Path("/nonexistent"),
        events=events,
        probe_timeout_s=1,
        stop_deadline_s=1,
        on_verdict=lambda _verdict: None,
        quiet=lambda: False,
    )


def test_the_verdict_names_the_storage_and_each_stuck_rank_with_its_call() -> None:
    verdict = NodeVerdict(
        "the storage under /runs/a does not answer",
        [
            {
                "rank": 0,
                "pid": 11,
                "state": "disk-sleep",
                "syscall": "pwrite64",
                "path": "/runs/a/x",
            },
            {"rank": 3, "pid": 14, "state": "disk-sleep"},
        ],
        at=0.0,
    )
    assert verdict.lines() == [
        "the storage under /runs/a does not answer",
        "rank 0 (pid 11) outlived SIGKILL: disk-sleep, blocked in pwrite64(/runs/a/x)",
        "rank 3 (pid 14) outlived SIGKILL: disk-sleep, not in a file call /proc can name",
    ]


def test_only_a_failure_of_the_current_round_is_judged() -> None:
    events = LauncherEvents(joins=[100.0])
    watch = _watch(events)
    assert watch._failure_since_last_start() is None
    events.monitor_timeouts.append({"time": 90.0, "rank": 0})  # before the round began
    assert watch._failure_since_last_start() is None
    events.monitor_timeouts.append({"time": 130.0, "rank": 1})
    events.detections.append(125.0)
    assert watch._failure_since_last_start() == 125.0  # the first of the round's failures
    events.joins.append(140.0)  # the launcher restarted the group: a new round
    assert watch._failure_since_last_start() is None
