"""ft_launcher: a hung rank is detected by its section timeout, the group restarts, and the run
resumes exactly; timeouts are learned with a floor and persisted."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from launch.common import plan_launch
from launch.local import launcher_command
from pretrain.context.failures import classify
from pretrain.context.run_dir import RunDir
from pretrain.train.hooks import StepResult
from recipes.config.resiliency import WatchConfig
from resiliency.monitor.fault_tolerance import launcher_config
from resiliency.monitor.stacks import StackWatchdog, read_stack_dump
from resiliency.monitor.watch import RestoreDivergedError, jumps
from tests.ft_helpers import (
    CHECK_S,
    FLOOR_S,
    SAVE_EVERY,
    attempts,
    base_overrides,
    clean_run,
    launch_local,
)
from tests.helpers import losses

HANG_STEP = 7


def test_launcher_config_uses_sections_not_heartbeats(
    tiny_overrides: list[str], tmp_path: Path
) -> None:
    run = plan_launch([*base_overrides(tiny_overrides, tmp_path, "cfg")]).run
    ft = launcher_config(run)["fault_tolerance"]
    # Unobserved bounds; every rank replaces them with learned ones (test_hangs.py).
    assert ft["rank_section_timeouts"] == {
        "setup": 600.0,
        "step": 600.0,
        "eval": 600.0,
        "checkpointing": 60.0,
    }
    assert ft["rank_out_of_section_timeout"] == 600.0
    assert ft["initial_rank_heartbeat_timeout"] is None and ft["rank_heartbeat_timeout"] is None
    assert ft["enable_nic_monitor"] is False  # CPU: no RDMA counters to watch


def test_launcher_command_per_backend(tiny_overrides: list[str], tmp_path: Path) -> None:
    ft_plan = plan_launch(base_overrides(tiny_overrides, tmp_path, "cmd"))
    ft_cmd = launcher_command(ft_plan, tmp_path / "c.yaml", restarts=2)
    assert Path(ft_cmd[0]).name == "ft_launcher" and "--max-restarts=2" in ft_cmd
    assert any(a.startswith("--ft-cfg-path=") for a in ft_cmd)
    assert "--workers-stop-timeout=10" in ft_cmd  # a restart's SIGTERM grace, not nvrx's 30 s
    tr_plan = plan_launch([*tiny_overrides, f"output_dir={tmp_path}", "launch.backend=torchrun"])
    tr_cmd = launcher_command(tr_plan, tmp_path / "c.yaml", restarts=2)
    # torchrun never restarts by itself: the wrapper decides from the attempt records.
    assert tr_cmd[1:3] == ["-m", "launch.torchrun"] and "--max-restarts=0" in tr_cmd
    assert tr_cmd[-4:] == ["-m", "pretrain", "--config", str(tmp_path / "c.yaml")]


def test_stack_watchdog_dumps_before_the_timeout_and_forgets_false_alarms(tmp_path: Path) -> None:
    watchdog = StackWatchdog(tmp_path / "rank-00001.pid-1.txt", rank=1)
    watchdog.arm("step", 0.3, step=7, attempt=2)
    time.sleep(0.6)  # "hung": the dump fires at 0.9 x the timeout
    dump = read_stack_dump(watchdog.path)
    assert dump["dumped"] and not dump["in_collective"]
    assert (dump["rank"], dump["step"], dump["attempt"], dump["section"]) == (1, 7, 2, "step")
    assert any("test_stack_watchdog" in frame for frame in dump["top_frames"])
    watchdog.arm("step", 60, step=8)  # the step finished after all: the dump was a false alarm
    assert read_stack_dump(watchdog.path)["dumped"] is False
    watchdog.close()
    assert not watchdog.path.exists()  # nothing worth keeping


def test_post_restore_watch_flags_jumps_only() -> None:
    cfg = WatchConfig(loss_tolerance=0.1, grad_norm_tolerance=1.0)
    before = {"step": 5, "loss": 4.0, "grad_norm": 2.0}
    assert jumps(StepResult(5, 4.3, 3.9, 1e-3, 0.2, 1e3), before, cfg) == []
    assert jumps(StepResult(5, 3.0, 0.5, 1e-3, 0.2, 1e3), before, cfg) == []  # drops are fine
    found = jumps(StepResult(5, 4.5, 4.5, 1e-3, 0.2, 1e3), before, cfg)
    assert [f.split()[0] for f in found] == ["loss", "grad_norm"]
    assert classify(RestoreDivergedError("; ".join(found))).kind == "numeric"  # not retried


@pytest.mark.slow
@pytest.mark.current_stack
def test_hang_is_detected_restarted_and_resumes_exactly(
    tiny_overrides: list[str], tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    clean = clean_run(tiny_overrides, tmp_path_factory.getbasetemp())
    # "/0": hang only in the first launcher round, so the restarted group runs clean.
    proc = launch_local(
        [*base_overrides(tiny_overrides, tmp_path, "hang"), f"train.fault=hang@{HANG_STEP}:1/0"]
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    run_dir = tmp_path / "hang"
    first, second = attempts(run_dir)

    # Root cause: rank 1 hung; rank 0's stack shows it only waited in a collective.
    assert first["status"] == "failed" and first["failure_class"] == "infrastructure"
    assert first["first_failing_rank"] == 1 and "hang" in first["failure_cause"]
    assert {e["rank"]: e["victim"] for e in first["evidence"]} == {0: True, 1: False}

    # Detected within the learned (floored) step timeout plus the monitor's check interval.
    timeouts = first["monitor_timeouts"]
    assert timeouts and all(t["section"] == "step" for t in timeouts)
    for t in timeouts:
        assert FLOOR_S <= t["timeout_s"] <= t["open_s"] <= t["timeout_s"] + 2 * CHECK_S + 1.5
    rto = first["rto"]
    phases = ("detection", "teardown", "spawn", "restore_read", "first_step", "total")
    assert all(rto[f"{k}_s"] is not None for k in phases)
    assert rto["detection_s"] <= timeouts[0]["timeout_s"] + 4

    # Restarted from the newest verified checkpoint, lost only the steps after it.
    restored = (HANG_STEP - 1) // SAVE_EVERY * SAVE_EVERY
    assert second["status"] == "finished" and second["restored_step"] == restored
    assert first["lost_steps"] == HANG_STEP - 1 - restored
    assert second["recovered_from"]["lost_steps"] == HANG_STEP - 1 - restored
    assert second["post_restore_watch"]["ok"]
    assert losses(run_dir) == losses(clean)

    learned = json.loads(RunDir(run_dir).timeouts_path.read_text())
    assert learned["timeouts"]["step"] >= FLOOR_S and len(learned["samples"]["step"]) >= 3
