"""P1-P3 from measurements written by hand: each expected figure is worked out here, so the
bench's arithmetic (not the machine) is what is tested."""

from __future__ import annotations

import pytest

from bench.__main__ import restore_figures, save_figures


def _async(blocked_call: float, commit: float, memcpy: float) -> dict:
    return {
        "save_call_s": blocked_call,
        "commit_s": commit,
        "blocked_s": blocked_call + commit,
        "memcpy_s": memcpy,
        "idle_steps": [1.0, 1.0, 1.2],  # median 1.0
        "busy_steps": [1.5, 1.1],  # median 1.3: a 30 % slowdown, 0.6 s lost
        "raw_busy_steps": [1.2],
    }


def _raw() -> dict:
    # 2 ranks x 100 bytes each; the raw write of those 200 bytes took 1 s (200 B/s).
    sync = [
        [{"bytes": 200, "save_s": 2.0, "raw_s": 1.0, "raw_after_save_s": 2.0,
          "phases": {"write": 1.5}, "reread_checksum_s": 0.1},
         {"bytes": 200, "save_s": 1.0, "raw_s": 1.0, "raw_after_save_s": 1.0,
          "phases": {"write": 0.5}, "reread_checksum_s": 0.1},
         {"bytes": 200, "save_s": 4.0, "raw_s": 1.0, "raw_after_save_s": 1.0,
          "phases": {"write": 3.0}, "reread_checksum_s": 0.1}],
    ]  # fmt: skip
    return {
        "bytes": 200,
        "bytes_per_rank": 100,
        "sync": sync,
        "async": [_async(0.1, 0.05, 0.1), _async(0.3, 0.0, 0.1)],
        "async_first": {**_async(0.2, 0.1, 0.1), "reserve_s": 0.05},
    }


def test_p1_is_the_median_pairs_save_bandwidth_over_the_raw_writes() -> None:
    figures = save_figures(_raw())
    # save 100, 200 and 50 B/s over the raw write's 200 B/s: 0.5, 1.0, 0.25 -> median 0.5
    assert figures["P1"]["median"] == pytest.approx(0.5)
    assert figures["P1_pairs"] == 3
    assert figures["save_phases_s"] == {"write": 1.5}


def test_p2_compares_the_blocked_time_with_twice_the_memcpy_plus_50_ms() -> None:
    figures = save_figures(_raw())
    # blocked 0.15 and 0.3 s, memcpy 0.1 s each: ratios 1.5 and 3.0
    assert figures["P2_blocked_over_memcpy"]["median"] == pytest.approx(2.25)
    # median blocked 0.225 <= 2 x 0.1 + 0.05 = 0.25
    assert figures["P2_goal_met"] is True
    assert figures["P2_first_blocked_over_memcpy"] == pytest.approx(3.0)
    assert figures["P2_first_goal_met"] is False  # 0.3 > 0.25
    assert figures["P2_step_slowdown"]["median"] == pytest.approx(0.3)
    assert figures["P2_lost_s_per_save"]["median"] == pytest.approx(0.6)  # 2.6 - 2 x 1.0


def test_p3_is_what_a_restore_adds_to_a_start_over_the_cold_read() -> None:
    samples = [
        {"resumed_s": 10.0, "fresh_s": 8.0, "read_s": 2.0, "first_step_s": 11.0},  # 1.0
        {"resumed_s": 9.0, "fresh_s": 8.0, "read_s": 2.0, "first_step_s": 10.0},  # 0.5
        {"resumed_s": 12.0, "fresh_s": 8.0, "read_s": 2.0, "first_step_s": 13.0},  # 2.0
        {"resumed_s": 11.0, "fresh_s": 8.0, "read_s": 2.0, "first_step_s": 12.0},  # 1.5
    ]
    figures = restore_figures(samples, nbytes=2 << 30, pairs=2)
    # repetitions: median(1.0, 0.5) = 0.75 and median(2.0, 1.5) = 1.75; their median 1.25
    assert figures["P3"]["median"] == pytest.approx(1.25)
    assert figures["P3_goal_met"] is True  # <= 1.25
    assert figures["P3_added_s"]["median"] == pytest.approx(2.5)
    assert figures["read_GiBps"]["median"] == pytest.approx(1.0)
    samples[0]["resumed_s"] = 10.2  # 1.1: repetition 1 becomes 0.8, the median 1.275
    assert restore_figures(samples, nbytes=2 << 30, pairs=2)["P3_goal_met"] is False
