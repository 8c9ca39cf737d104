"""Hangs in every phase: learned bounded timeouts per section, the stopped rank named from
liveness heartbeats, RTO measured from the hung rank's last progress.

The end-to-end tests SIGSTOP a random rank (a real stop: the whole process freezes, every thread
with it) in a step, a sync save, an async commit, a restore and a validation, under ft_launcher
on 2 CPU ranks, and one SIGSTOPs random ranks at random moments from outside.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from bench.hang_detection import stop_a_random_rank
from pretrain.context.run_dir import RunDir
from recipes.config.resiliency import FtConfig
from resiliency.monitor.attribution import UNDETERMINED, attribute_hang
from resiliency.monitor.fault_tolerance import load_timeouts
from resiliency.monitor.stacks import BEAT_S, StackWatchdog, read_stack_dump
from resiliency.monitor.timeouts import OUT_OF_SECTION, SectionTimeouts, p99
from tests.ft_helpers import (
    CHECK_S,
    FLOOR_S,
    attempts,
    base_overrides,
    clean_run,
    env,
    launch_cmd,
    launch_local,
)
from tests.helpers import REPO, losses

CFG = FtConfig(timeout_floor_s=30.0, timeout_multiplier=3.0, learn_after_steps=3)


# ---------------------------------------------------------------- the timeout rule
def test_unobserved_sections_are_bounded_by_checkpoint_bytes() -> None:
    timeouts = SectionTimeouts(CFG)
    timeouts.set_checkpoint_bytes(17_000_000_000, restoring=True)  # 70B on 64 ranks
    transfer = 17e9 / 50e6
    assert timeouts.timeout("checkpointing") == pytest.approx(60 + transfer, abs=0.01)
    assert timeouts.timeout("setup") == pytest.approx(600 + transfer, abs=0.01)
    assert timeouts.timeout("step") == 600 and timeouts.timeout(OUT_OF_SECTION) == 600
    fresh = SectionTimeouts(CFG)
    fresh.set_checkpoint_bytes(17_000_000_000, restoring=False)
    assert fresh.timeout("setup") == 600  # nothing to read back
    assert "340 s" not in fresh.rule("setup") and "MB at 50 MB/s" in fresh.rule("checkpointing")


def test_observed_sections_learn_3x_p99_with_a_floor() -> None:
    timeouts = SectionTimeouts(CFG)
    timeouts.observe("checkpointing", 20.0)
    assert timeouts.learned("checkpointing") and timeouts.timeout("checkpointing") == 60.0
    timeouts.observe("step", 1.0)
    timeouts.observe("step", 2.0)
    assert not timeouts.learned("step") and timeouts.timeout("step") == 600  # 3 needed
    timeouts.observe("step", 1.5)
    assert timeouts.timeout("step") == 30.0  # 3 x 2.0 s is under the floor
    samples = [1.0] * 98 + [12.0, 50.0]  # one outlier in a hundred does not set the timeout
    assert p99(samples) == 12.0
    for value in samples:
        timeouts.observe("step", value)
    assert timeouts.timeout("step") == 36.0
    # A setup learned from fresh starts only still gets the restore's read on top.
    timeouts.observe("setup", 40.0)
    timeouts.set_checkpoint_bytes(5_000_000_000, restoring=True)
    assert timeouts.timeout("setup") == pytest.approx(120 + 100, abs=0.01)
    timeouts.observe("setup", 90.0, restored=True)
    assert timeouts.timeout("setup") == 270.0


def test_observations_persist_for_the_next_attempt(tmp_path: Path) -> None:
    timeouts = SectionTimeouts(CFG)
    for value in (0.2, 0.3, 0.25):
        timeouts.observe("step", value)
    RunDir(tmp_path).timeouts_path.write_text(json.dumps(timeouts.state()))
    again = SectionTimeouts(CFG, load_timeouts(tmp_path))
    assert again.samples["step"] == [0.2, 0.3, 0.25] and again.timeout("step") == 30.0
    assert load_timeouts(tmp_path / "missing") is None
    RunDir(tmp_path).timeouts_path.write_text(json.dumps({"client_state": {}}))  # older format
    assert load_timeouts(tmp_path) is None


# ---------------------------------------------------------------- attribution
def _dump(rank: int, beat_at: float, **extra: Any) -> dict[str, Any]:
    return {"rank": rank, "beat_at": beat_at, "stall_s": 0.0, "progress_at": 100.0, **extra}


def test_the_rank_that_stopped_beating_is_named_with_its_last_progress() -> None:
    # Both stacks alike (both waiting in a collective): the heartbeat still tells.
    dumps = {
        0: _dump(0, 140.0, dumped=True, in_collective=True),
        1: _dump(1, 104.5, dumped=True, in_collective=True),
    }
    found = attribute_hang(dumps)
    assert (found["rank"], found["rule"], found["last_progress_at"]) == (1, "heartbeat", 104.5)
    # Continued before its kill: the stall is in its record, the peers never stalled.
    dumps[1] = _dump(1, 140.2, stall_s=30.1, stall_from=105.0, dumped=True, in_collective=True)
    found = attribute_hang(dumps)
    assert (found["rank"], found["last_progress_at"]) == (1, 105.0)


def test_a_rank_killed_by_its_own_monitor_is_not_the_stopped_one() -> None:
    """Rank 0 waited in a collective, its section timed out first and its monitor killed it
    (its beats end there); rank 1 hung alive, beating until the teardown 30 s later. Seen
    in a soak: without the kill time, rank 0 read as the rank that stopped."""
    dumps = {
        0: _dump(0, 145.9, dumped=True, in_collective=True),
        1: _dump(1, 176.5, dumped=True, in_collective=False, section="step"),
    }
    found = attribute_hang(dumps, killed_at={0: 146.0})
    assert (found["rank"], found["rule"]) == (1, "stack")
    assert attribute_hang(dumps)["rank"] == 0  # what the beats alone would say
    # A stopped rank killed by its own monitor still shows the stall up to the kill.
    stopped = {0: _dump(0, 150.0), 1: _dump(1, 110.0)}
    assert attribute_hang(stopped, killed_at={1: 118.5})["rank"] == 1


def test_alive_hang_is_named_from_stacks_and_ties_are_undetermined() -> None:
    alive = {
        0: _dump(0, 140.0, dumped=True, in_collective=True),
        1: _dump(1, 140.1, dumped=True, in_collective=False, section="step"),
    }
    assert attribute_hang(alive)["rank"] == 1 and attribute_hang(alive)["rule"] == "stack"
    alike = {r: _dump(r, 140.0, dumped=True, in_collective=True) for r in range(4)}
    assert attribute_hang(alike)["rank"] == UNDETERMINED
    node = {0: _dump(0, 140.0), 1: _dump(1, 140.0), 2: _dump(2, 110.0), 3: _dump(3, 110.2)}
    found = attribute_hang(node)  # a whole node stopped: two ranks, same moment
    assert found["rank"] == UNDETERMINED and found["candidates"] == [2, 3]
    assert attribute_hang({})["rank"] == UNDETERMINED


def test_a_stopped_process_stops_beating_and_shows_the_stall(tmp_path: Path) -> None:
    """A real SIGSTOP of a process running the watchdog; SIGCONT, then read its record."""
    path = tmp_path / "rank-00003.pid-0.txt"
    code = (
        "import sys, time\n"
        f"sys.path.insert(0, {str(REPO)!r})\n"
        "from pathlib import Path\n"
        "from resiliency.monitor.stacks import StackWatchdog\n"
        f"w = StackWatchdog(Path({str(path)!r}), rank=3)\n"
        "w.arm('step', 600.0, step=1)\n"
        "time.sleep(60)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        _wait_for(lambda: (read_stack_dump(path) or {}).get("stall_from") is not None, 20)
        os.kill(child.pid, signal.SIGSTOP)
        stopped_at = time.time()
        time.sleep(3.0)
        frozen = read_stack_dump(path)
        assert frozen["beat_at"] <= stopped_at + 0.05  # no beat while stopped
        os.kill(child.pid, signal.SIGCONT)
        time.sleep(3 * BEAT_S)
        record = read_stack_dump(path)
    finally:
        child.kill()
        child.wait()
    assert record["beat_at"] > stopped_at + 3.0
    assert 2.0 <= record["stall_s"] <= 4.0 and record["stall_from"] <= stopped_at
    assert record["section"] == "step" and record["rank"] == 3


def test_watchdog_heartbeat_costs_one_write_per_beat(tmp_path: Path) -> None:
    watchdog = StackWatchdog(tmp_path / "rank-00000.pid-1.txt", rank=0)
    watchdog.arm("step", 60.0, step=1)
    time.sleep(4 * BEAT_S)
    first = read_stack_dump(watchdog.path)["beat_at"]
    time.sleep(2 * BEAT_S)
    assert read_stack_dump(watchdog.path)["beat_at"] > first
    watchdog.close()
    assert not watchdog.path.exists()


def test_a_failed_rank_keeps_its_beats_so_a_stopped_peer_is_still_named(tmp_path: Path) -> None:
    """Rank 1 stops; rank 0 beats on until the collective it waits in fails, then exits by
    that exception (no dump): its kept beats are what rank 1's silence is measured against."""
    stopped = StackWatchdog(tmp_path / "rank-00001.pid-2.txt", rank=1)
    stopped.arm("checkpointing", 600.0, step=10)
    time.sleep(2 * BEAT_S)
    stopped._stop.set()  # frozen: no beat from here on
    waiting = StackWatchdog(tmp_path / "rank-00000.pid-1.txt", rank=0)
    waiting.arm("step", 600.0, step=10)
    time.sleep(6 * BEAT_S)
    waiting.close(keep=True)  # failed: "lost peer"
    assert waiting.path.exists()
    dumps = {r: read_stack_dump(tmp_path / f"rank-{r:05d}.pid-{r + 1}.txt") for r in (0, 1)}
    assert attribute_hang(dumps)["rank"] == 1
    del dumps[0]  # what a clean close left before: nothing to measure the silence against
    assert attribute_hang(dumps)["rank"] == "undetermined"


def _wait_for(check: Any, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if check():
            return
        time.sleep(0.1)
    raise AssertionError("timed out waiting")


# ---------------------------------------------------------------- end to end
SEED = int(os.environ.get("HANG_TEST_SEED", "0")) or random.SystemRandom().randrange(1, 1 << 30)


def _rng(name: str) -> random.Random:
    print(f"{name}: HANG_TEST_SEED={SEED}")  # shown on failure: rerun with the same stops
    return random.Random(f"{SEED}-{name}")


def _assert_caught_within_goal(
    record: dict[str, Any], section: str, run_dir: Path, floor_s: float = FLOOR_S
) -> None:
    """Torn down within max(3 x p99, floor) + 5 s of the hung rank's last progress."""
    samples = json.loads(RunDir(run_dir).timeouts_path.read_text())["samples"][section]
    goal = max(3 * p99(samples), floor_s) + 5
    monitor = record["monitor_timeouts"]
    assert monitor and {t["section"] for t in monitor} == {section}, monitor
    assert all(t["open_s"] <= t["timeout_s"] + 2 * CHECK_S + 1.5 for t in monitor)
    assert min(t["timeout_s"] for t in monitor) <= goal - 5 + 0.5  # setup adds its read
    rto = record["rto"]
    assert rto["fault_at_clock"] < rto["detected_at_clock"]
    assert 0 < rto["detection_s"] <= goal, (rto, goal)
    if rto["total_s"] is not None:  # None: the next attempt failed before its first step
        assert rto["total_s"] >= rto["detection_s"] + rto["teardown_s"]


def _leftovers(root: Path) -> list[int]:
    """Processes still running anything of this test's run (workers, monitors, launcher)."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if str(root) in cmdline and proc.info["pid"] != os.getpid():
            found.append(proc.info["pid"])
    return found


# Not in the current-stack leg (1.2 min there): nvrx 0.7's rank monitor, its detection and
# the attribution are covered there by the async-commit test below and test_ft's hang test.
@pytest.mark.slow
def test_stops_in_a_step_a_save_a_restore_and_an_eval_are_caught_and_resume_exactly(
    tiny_overrides: list[str], tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    clean = clean_run(tiny_overrides, tmp_path_factory.getbasetemp())
    rng = _rng("phases")
    ranks = [rng.randrange(2) for _ in range(4)]
    # Round 0 stops before step 6, round 1 in the save of step 8 (so 4 stays the newest
    # verified step), round 2 while it restores step 4, round 3 in the validation at step 5;
    # round 4 runs clean to the end. Validation moves no training state: the clean run has none.
    faults = (
        f"stop@6:{ranks[0]}/0;stop_save@8:{ranks[1]}/1;stop_restore@4:{ranks[2]}/2;"
        f"stop_eval@5:{ranks[3]}/3"
    )
    proc = launch_local(
        [
            *base_overrides(tiny_overrides, tmp_path, "stops"),
            "launch.standby=true",  # its four restarts skip the imports (and prove them exact)
            "train.eval_interval=5",
            "train.eval_iters=2",
            f'train.fault="{faults}"',
        ],
        max_restarts=4,
        timeout=360,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    run_dir = tmp_path / "stops"
    records = attempts(run_dir)
    assert [r["status"] for r in records] == ["failed"] * 4 + ["finished"]
    sections = ("step", "checkpointing", "setup", "eval")
    for record, rank, section in zip(records, ranks, sections):
        assert record["first_failing_rank"] == rank, record.get("hang")
        assert record["hang"]["rule"] == "heartbeat" and section in record["failure_cause"]
        _assert_caught_within_goal(record, section, run_dir)
    assert [r.get("restored_step") for r in records] == [None, 4, None, 4, 4]
    assert losses(run_dir) == losses(clean)
    assert _leftovers(tmp_path) == []


# Our own commit-section watchdog, not the nvrx release: leg 2 has nvrx's hang path in
# tests/integration/test_ft.py, and this one runs in leg 1 only.
@pytest.mark.slow
def test_a_stop_in_an_async_commit_is_caught_and_resumes_exactly(
    tiny_overrides: list[str], tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    clean = clean_run(tiny_overrides, tmp_path_factory.getbasetemp())
    rank = _rng("commit").randrange(2)
    # A higher floor than the other tests': the commit section also holds the wait on the
    # previous write, whose nice-19 writer two busy ranks starve on two cores; with 4 s the
    # section once timed out ~1 s after the stop, too short a stall to name the stopped rank.
    floor_s = 2 * FLOOR_S
    proc = launch_local(
        [
            *base_overrides(tiny_overrides, tmp_path, "commit", floor_s=floor_s),
            "checkpoint.async_save=true",
            f"train.fault=stop_save@8:{rank}/0",  # the commit runs before step 9
        ]
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    run_dir = tmp_path / "commit"
    first, second = attempts(run_dir)
    assert first["first_failing_rank"] == rank, first.get("hang")
    _assert_caught_within_goal(first, "checkpointing", run_dir, floor_s)
    assert second["status"] == "finished" and second["restored_step"] == 4
    assert losses(run_dir) == losses(clean)
    assert _leftovers(tmp_path) == []


# Exhaustive (make test-all): the per-section test above stops a rank in every section;
# `python -m bench --only P4` measures random stops from outside (10 by default).
@pytest.mark.slow
@pytest.mark.exhaustive
def test_random_stops_from_outside_name_the_stopped_rank(
    tiny_overrides: list[str], tmp_path: Path
) -> None:
    rng, stops = _rng("random"), 4
    overrides = [
        *base_overrides(tiny_overrides, tmp_path, "random"),
        "train.train_steps=60",
        # Sync saves: an async save's blocking wait on its nice-19 writer, starved by two busy
        # ranks on two cores, outlasted the 4 s test floor once (a false hang, not a stop);
        # the async commit has its own test above.
        "checkpoint.save_interval=3",
    ]
    log = tmp_path / "launcher.log"  # a file, not a pipe: an unread pipe stalls the launcher
    run_dir = tmp_path / "random"
    with log.open("w") as sink:
        proc = subprocess.Popen(
            launch_cmd(overrides, max_restarts=stops),
            cwd=REPO,
            env=env(),
            text=True,
            stdout=subprocess.DEVNULL,
            stderr=sink,
        )
        try:
            stopped = [
                stop_a_random_rank(tmp_path, r, run_dir / "metrics" / "steps.jsonl", rng)
                for r in range(stops)
            ]
            proc.wait(timeout=400)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 0, log.read_text()[-6000:]
    records = attempts(run_dir)
    assert [r["status"] for r in records] == ["failed"] * stops + ["finished"]
    named = [r["first_failing_rank"] for r in records[:stops]]
    assert named == stopped, [r.get("hang") for r in records[:stops]]
    for record in records[:stops]:
        rto = record["rto"]
        assert 0 < rto["detection_s"] <= max(t["timeout_s"] for t in record["monitor_timeouts"]) + 5
    assert _leftovers(tmp_path) == []
