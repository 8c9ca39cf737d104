"""Hang detection under nvidia-resiliency-ext's ft_launcher: rank sections and their timeouts.

Every rank reports sections to its rank monitor (a process ft_launcher runs per rank):
``setup`` (connect -> first step: model build, restore), ``step`` (one training step) and
``checkpointing`` (saves, async commits, the final and emergency saves); anything else is
"out of section". A section open longer than its timeout gets the rank SIGKILLed, ft_launcher
tears the whole worker group down and restarts it, and the new group resumes from the newest
verified checkpoint.

Timeouts start from ``resiliency.ft.*``; after ``learn_after_steps`` steps the ``step`` and
out-of-section timeouts are learned (``timeout_multiplier`` x the slowest observed on any rank,
never below ``timeout_floor_s``) and persisted in ``<run_dir>/ft_timeouts.json``, which later
attempts load before their first section.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from pretrain import exit_codes
from pretrain.failures import classify
from pretrain.hooks import StepResult, TrainHook
from resiliency.monitor.stacks import STACKS_DIR, StackWatchdog, stack_path
from resiliency.storage.layout import RunLayout, atomic_write_json

if TYPE_CHECKING:
    from pretrain.distributed import DistEnv
    from pretrain.loop import Trainer
    from recipes.schema import FtConfig, RunConfig
    from resiliency.checkpoint.hook import CheckpointHook

log = logging.getLogger(__name__)
SECTIONS = ("setup", "step", "checkpointing")
TIMEOUTS_FILE = "ft_timeouts.json"
LAUNCHER_CONFIG_FILE = "ft_launcher.yaml"
MONITOR_SOCKET_ENV = "FT_RANK_MONITOR_IPC_SOCKET"  # set by ft_launcher for its ranks


def under_ft_launcher() -> bool:
    return bool(os.environ.get(MONITOR_SOCKET_ENV))


# ------------------------------------------------------------------ launcher side
def launcher_config(run: "RunConfig") -> dict[str, Any]:
    """ft_launcher's ``fault_tolerance`` section: sections only, heartbeats off."""
    ft = run.resiliency.ft
    return {
        "fault_tolerance": {
            "workload_check_interval": ft.check_interval_s,
            "initial_rank_heartbeat_timeout": None,
            "rank_heartbeat_timeout": None,
            "rank_section_timeouts": {
                "setup": ft.setup_timeout_s,
                "step": ft.step_timeout_s,
                "checkpointing": ft.checkpointing_timeout_s,
            },
            "rank_out_of_section_timeout": ft.out_of_section_timeout_s,
            "safety_factor": ft.timeout_multiplier,
            # NIC health checks read RDMA counters; there are none to read on a CPU box.
            "enable_nic_monitor": run.launch.gpus_per_node > 0,
        }
    }


def write_launcher_config(run: "RunConfig", run_dir: Path) -> Path:
    path = run_dir / LAUNCHER_CONFIG_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(launcher_config(run), sort_keys=False))
    tmp.replace(path)
    return path


# ------------------------------------------------------------------ learned timeouts
def load_timeouts(run_dir: Path, floor_s: float) -> dict[str, Any] | None:
    """RankMonitorClient state persisted by an earlier attempt, floored (None: nothing saved)."""
    try:
        saved = json.loads((run_dir / TIMEOUTS_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    state = saved.get("client_state", {})
    section = state.get("current_timeouts", {}).get("section")
    if section:
        section.update(_floor_section(section, floor_s))
    return state


def _floor_section(section: dict[str, Any], floor_s: float) -> dict[str, Any]:
    timeouts = dict(section["section"])
    for name in section.get("calculated_sections", []):
        if timeouts.get(name) is not None:
            timeouts[name] = max(timeouts[name], floor_s)
    oos = section.get("out_of_section")
    if section.get("is_out_of_section_calculated") and oos is not None:
        oos = max(oos, floor_s)
    return {"section": timeouts, "out_of_section": oos}


# ------------------------------------------------------------------ rank side
class FaultToleranceHook(TrainHook):
    """Sections for the rank monitor, learned timeouts, stack dumps, no restart on bugs."""

    def __init__(
        self, cfg: "FtConfig", env: "DistEnv", run_dir: Path, checkpoint: "CheckpointHook | None"
    ) -> None:
        self.cfg, self.env, self.run_dir, self.checkpoint = cfg, env, run_dir, checkpoint
        self.client: Any = None
        self.open: list[str] = []
        self.paused: list[str] = []  # sections closed while a checkpoint runs
        self.steps_done = 0
        self.step = 0
        self.stacks: StackWatchdog | None = None
        self.heartbeats_only = False

    # -- lifecycle
    def configure(self, run: "RunConfig", dp: int) -> "RunConfig":
        # nvrx: loaded only where the feature runs
        from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient

        self.client = RankMonitorClient()
        self.client.init_workload_monitoring()
        missing = set(SECTIONS) - set(self.client.cfg.rank_section_timeouts)
        if missing:
            # Sections unknown to the launcher's config would fail every rank; heartbeats work
            # with any config (e.g. ft_launcher started without resiliency.ft's YAML).
            log.warning(
                "ft: launcher config has no %s section timeouts (start ft_launcher with "
                "--ft-cfg-path from resiliency.ft.write_launcher_config); sending "
                "heartbeats only",
                sorted(missing),
            )
            self.heartbeats_only = True
            return run
        state = load_timeouts(self.run_dir, self.cfg.timeout_floor_s)
        if state:
            self.client.load_state_dict(state)  # learned by an earlier attempt
        if self.cfg.stack_dumps:
            stacks = RunLayout.from_run_dir(self.run_dir).attempts_dir / STACKS_DIR
            path = stack_path(stacks, self.env.rank, os.getpid())
            self.stacks = StackWatchdog(path, self.env.rank)
        if self.env.rank == 0:
            log.info("ft: rank monitors connected; %s", self.client.section_timeouts)
        self._open("setup")
        return run

    def on_start(self, trainer: "Trainer") -> None:
        if self.stacks is not None and self.checkpoint is not None:
            self.stacks.context["attempt"] = self.checkpoint.ownership.attempt
        self.step = trainer.state.step

    def before_step(self, trainer: "Trainer") -> None:
        self.step = trainer.state.step + 1
        if self.heartbeats_only:
            self.client.send_heartbeat()
            return
        if "setup" in self.open:
            self._close("setup")
        self._open("step")

    def after_step(self, trainer: "Trainer", result: StepResult) -> None:
        if self.heartbeats_only:
            return
        self._close("step")
        self.steps_done += 1
        if self.cfg.learn_timeouts and self.steps_done == self.cfg.learn_after_steps:
            self._learn(result.step)

    def on_end(self, trainer: "Trainer") -> None:
        if trainer.exit_code in exit_codes.DO_NOT_RETRY:
            self._request_shutdown(f"planned exit {trainer.exit_code}")

    def on_exception(self, trainer: "Trainer | None", exc: BaseException) -> None:
        failure = classify(exc)
        if not failure.retryable:
            # ft_launcher would restart the group on any failure; a deterministic one would
            # only fail again, so ask it to stop instead.
            self._request_shutdown(f"{failure.kind}: {failure.message[:200]}")

    def close(self) -> None:
        if self.stacks is not None:
            self.stacks.close()
        if self.client is not None and self.client.is_initialized:
            self.client.end_all_sections()
            self.client.shutdown_workload_monitoring()

    # -- sections
    def _open(self, section: str) -> None:
        self.client.start_section(section)
        self.open.append(section)
        if self.stacks is not None:
            timeout = self.client.section_timeouts.section.get(section)
            self.stacks.arm(section, timeout, step=self.step)

    def _close(self, section: str) -> None:
        if self.stacks is not None:
            self.stacks.disarm()
        self.client.end_section(section)
        self.open.remove(section)

    def on_checkpoint_begin(self, trainer: "Trainer", what: str) -> None:
        # Saves happen inside other sections (after a step, before one for an async commit,
        # in the preemption hook, at the end); checkpointing has its own, longer timeout.
        if self.heartbeats_only:
            return
        self.paused = list(self.open)
        for section in self.paused:
            self._close(section)
        self._open("checkpointing")

    def on_checkpoint_end(self, trainer: "Trainer", what: str) -> None:
        if self.heartbeats_only:
            return
        self._close("checkpointing")
        for section in self.paused:
            self._open(section)
        self.paused = []

    # -- timeouts
    def _learn(self, step: int) -> None:
        client = self.client
        if not client.calculate_and_set_section_timeouts(
            selected_sections=["step"], calc_out_of_section=True, skip_if_not_ready=True
        ):
            return
        current = dataclasses.asdict(client.section_timeouts)
        current.update(_floor_section(current, self.cfg.timeout_floor_s))
        client.load_state_dict({"current_timeouts": {"section": current}})
        if self.env.rank != 0:
            return
        observed = client.timeouts_calc
        log.info(
            "ft: learned timeouts at step %d: step %.1f s (slowest %.2f s x %.0f, floor "
            "%.0f s), out-of-section %.1f s (slowest %.2f s)",
            step,
            client.section_timeouts.section["step"],
            observed.section_to_max_time["step"],
            self.cfg.timeout_multiplier,
            self.cfg.timeout_floor_s,
            client.section_timeouts.out_of_section,
            observed.out_of_section_max_time,
        )
        atomic_write_json(
            self.run_dir / TIMEOUTS_FILE,
            {
                "client_state": client.state_dict(),
                "learned_at_step": step,
                "time": time.time(),
                "observed_max_s": {
                    "step": observed.section_to_max_time["step"],
                    "out_of_section": observed.out_of_section_max_time,
                },
                "multiplier": self.cfg.timeout_multiplier,
                "floor_s": self.cfg.timeout_floor_s,
            },
        )

    def _request_shutdown(self, reason: str) -> None:
        # nvrx: loaded only where the feature runs
        from nvidia_resiliency_ext.fault_tolerance import WorkloadAction, WorkloadControlRequest

        try:
            self.client.send_workload_control_request(
                WorkloadControlRequest(WorkloadAction.ShutdownWorkload, reason)
            )
        except Exception as exc:  # noqa: BLE001 - best effort while the rank is failing
            log.warning("ft: could not ask ft_launcher to stop (%s)", exc)
