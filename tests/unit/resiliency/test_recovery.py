"""The recovery ledger's arithmetic on hand-made stamps, and the honest planner's formula.

The real-process proof (a kill from outside, the phases against the test's own clock) is
tests/integration/test_standby.py; here the boundaries are chosen by hand, so every expected
figure is a subtraction done in this file.
"""

from __future__ import annotations

import pytest

from resiliency.cli.capacity import predicted_goodput
from resiliency.monitor.recovery import PHASES, format_recovery, recovery_ledger

HOST = {"host": "node-a", "boot_id": "boot-1"}
MARKS = {
    "spawned": 103.0,
    "imports": 104.5,
    "process_group": 104.75,
    "setup": 105.0,
    "model_build": 105.5,
    "restore_read": 106.25,
    "restore_load": 106.5,
    "first_step": 107.0,
}


def _following(marks: dict[str, float], host: dict[str, str] = HOST) -> dict:
    return {"startup_clock": {**host, "marks": marks}}


def test_phases_are_the_gaps_between_boundaries_seen_by_each_process() -> None:
    rto = recovery_ledger(
        (100.0, "standby", "node-a/boot-1"), 100.5, 102.0, _following(MARKS), HOST
    )
    expected = {
        "detection_s": 0.5,
        "teardown_s": 1.5,
        "spawn_s": 1.0,
        "imports_s": 1.5,
        "process_group_s": 0.25,
        "setup_s": 0.25,
        "model_build_s": 0.5,
        "restore_read_s": 0.75,
        "restore_load_s": 0.25,
        "first_step_s": 0.5,
    }
    assert {k: rto[k] for k in expected} == expected
    assert rto["total_s"] == 7.0 == sum(expected.values())
    assert rto["absent"] == [] and rto["fault_at_clock"] == 100.0
    assert [f"{p}_s" for p in PHASES] == list(expected)


def test_nothing_restored_reads_zero_and_says_so() -> None:
    marks = {k: v for k, v in MARKS.items() if not k.startswith("restore")}
    rto = recovery_ledger(
        (100.0, "standby", "node-a/boot-1"), 100.5, 102.0, _following(marks), HOST
    )
    assert rto["restore_read_s"] == rto["restore_load_s"] == 0.0
    assert rto["first_step_s"] == 1.5  # model built at 105.5, first step at 107
    assert rto["absent"] == ["restore_read", "restore_load"]
    assert "(none)" in format_recovery(1, rto)


def test_phases_across_two_hosts_clocks_are_not_measured() -> None:
    other = {"host": "node-b", "boot_id": "boot-2"}
    rto = recovery_ledger(
        (100.0, "standby", "node-a/boot-1"), 100.5, 102.0, _following(MARKS, other), HOST
    )
    # The fault and the launcher's moments on node-a's clock, the new rank 0's on node-b's.
    assert (rto["detection_s"], rto["teardown_s"], rto["spawn_s"]) == (0.5, 1.5, None)
    assert rto["imports_s"] == 1.5  # rank 0's own phases still compare with each other
    assert rto["total_s"] is None and rto["cross_host"] == "node-b"


def test_the_planner_counts_what_a_real_run_pays() -> None:
    # Young/Daly alone: (1 - (60 + 50) / 3600) / (1 + 5 / 100)
    assert predicted_goodput(100.0, 5.0, 60.0, 3600.0) == pytest.approx((1 - 110 / 3600) / 1.05)
    # + a first start of 36 s per 3600 s of training, 4 s more for each attempt's first save,
    # and a 6 s save in flight lost with each fault: (1 - 120 / 3600) / (1 + 0.05 + 0.01)
    honest = predicted_goodput(
        100.0,
        5.0,
        60.0,
        3600.0,
        first_start_s=36.0,
        train_s=3600.0,
        first_save_extra_s=4.0,
        in_flight_s=6.0,
    )
    assert honest == pytest.approx((1 - 120 / 3600) / 1.06)


def test_a_fault_stamped_on_another_host_is_placed_by_its_wall_time() -> None:
    from resiliency.monitor.postmortem import LauncherEvents, recovery_times

    # The launcher reads its log on node-a, whose clock runs 1000 s ahead of the wall; the
    # rank died on node-b, whose clock runs 5000 s ahead: its stamp is 5100 at wall 100.
    events = LauncherEvents(clock_offset=1000.0, host=HOST)
    events.detections = [99.0, 100.4]  # the earlier one belongs to a previous failure
    events.joins = [101.5]
    failure = {
        "rank": 3,
        "time": 100.0,
        "clock": 5100.0,
        "host": "node-b",
        "boot_id": "boot-9",
        "source": "rank 3",
    }
    rto = recovery_times({}, failure, _following({}), events, (99.5, 200.0))
    assert rto["failure_at"] == 100.0  # node-b's stamp read with node-a's offset says 4100
    assert rto["detected_at_clock"] == 1100.4 and rto["fault_source"].startswith("the rank's")


def test_a_death_only_the_launcher_saw_has_no_measured_detection() -> None:
    from resiliency.monitor.postmortem import LauncherEvents, recovery_times

    # No reaper, no failure record with a clock: the fault's moment is the launcher's
    # detection (its log's wall stamp), so the detection phase is unknown, not 0.
    events = LauncherEvents(clock_offset=0.0, host=HOST)
    events.detections, events.joins = [100.5], [102.0]
    failure = {"rank": 1, "time": 101.0, "source": "launcher"}
    rto = recovery_times({}, failure, _following(MARKS), events, (99.0, 200.0))
    assert rto["detection_s"] is None and rto["not_measured"] == ["detection"]
    assert rto["teardown_s"] == 1.5 and rto["total_s"] == 6.5  # from the detection at 100.5
    shown = format_recovery(1, rto)
    assert "detection      not measured  (only the launcher saw the fault" in shown
    # A hang's moment comes from the rank's own beats (wall clock): detection is measured.
    hang = {"rank": 1, "time": 99.5, "source": "heartbeat"}
    rto = recovery_times({}, hang, _following(MARKS), events, (99.0, 200.0))
    assert rto["detection_s"] == 1.0 and rto["not_measured"] == []
    measured = recovery_ledger(
        (100.0, "standby", "node-a/boot-1"), 100.5, 102.0, _following(MARKS), HOST
    )
    assert measured["not_measured"] == [] and "not measured" not in format_recovery(1, measured)


def test_a_fault_rate_per_training_time_counts_the_recoveries_in_the_denominator() -> None:
    # T = 3600 s of training, a fault every 3600 s of it: one fault, 110 s of recovery and lost
    # work, saves 5 s every 100 s: wall = 3600 * 1.05 + 110, goodput = 3600 / wall.
    got = predicted_goodput(100.0, 5.0, 60.0, 3600.0, train_s=3600.0, mtbf_of_training=True)
    assert got == pytest.approx(3600 / (3600 * 1.05 + 110))
