"""Hang detection under nvidia-resiliency-ext's ft_launcher: rank sections and their timeouts.

Every rank reports sections to its rank monitor (a process ft_launcher runs per rank):
``setup`` (connect -> first step: model build, restore), ``step``, ``eval`` and
``checkpointing`` (sync saves, async commits, local-tier saves, the final and emergency saves);
anything else is "out of section". A section open longer than its timeout gets the rank
SIGKILLed, ft_launcher tears the whole worker group down and restarts it, and the new group
resumes from the newest verified checkpoint.

Every section's timeout is learned from its observed durations and bounded before the first
observation (:mod:`resiliency.monitor.timeouts`); observations persist in
``<run_dir>/ft_timeouts.json``, which later attempts load before their first section.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from pretrain.context import exit_codes
from pretrain.context.failures import classify
from pretrain.context.run_dir import RunDir
from pretrain.train.hooks import StepResult, TrainHook
from resiliency.monitor.stacks import STACKS_DIR, StackWatchdog, stack_path
from resiliency.monitor.timeouts import (
    BYTES_PER_PARAM,
    OUT_OF_SECTION,
    SECTIONS,
    SectionTimeouts,
    moved,
)
from resiliency.storage.layout import RunLayout, atomic_write_json
from resiliency.storage.manifest import ManifestError, read_manifest

if TYPE_CHECKING:
    from pretrain.platform.distributed import DistEnv
    from pretrain.train.hooks import EvalResult
    from pretrain.train.view import TrainerView
    from recipes.config.checkpoint import RemoteCheckpointConfig
    from recipes.config.resiliency import FtConfig
    from recipes.config.run import RunConfig
    from resiliency.run_context import RunContext

log = logging.getLogger(__name__)
LAUNCHER_CONFIG_FILE = "ft_launcher.yaml"
MONITOR_SOCKET_ENV = "FT_RANK_MONITOR_IPC_SOCKET"  # set by ft_launcher for its ranks


def under_ft_launcher() -> bool:
    return bool(os.environ.get(MONITOR_SOCKET_ENV))


# ------------------------------------------------------------------ launcher side
def launcher_config(run: "RunConfig") -> dict[str, Any]:
    """ft_launcher's ``fault_tolerance`` section: sections only, heartbeats off. These are the
    unobserved bounds; each rank replaces them with its learned ones once it connects."""
    ft = run.resiliency.ft
    return {
        "fault_tolerance": {
            "workload_check_interval": ft.check_interval_s,
            "initial_rank_heartbeat_timeout": None,
            "rank_heartbeat_timeout": None,
            "rank_section_timeouts": {
                "setup": ft.setup_timeout_s,
                "step": ft.step_timeout_s,
                "eval": ft.eval_timeout_s,
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
def load_timeouts(run_dir: Path) -> dict[str, Any] | None:
    """Observations persisted by an earlier attempt (None: nothing saved, or an old format)."""
    try:
        saved = json.loads(RunDir(run_dir).timeouts_path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return saved if isinstance(saved, dict) and "samples" in saved else None


def newest_rank_bytes(
    run_dir: Path, world_size: int, remote: "RemoteCheckpointConfig | None" = None
) -> tuple[int, bool]:
    """(bytes per rank of the newest published checkpoint, whether there is one to restore).
    With no local step but a remote tier, the restore downloads the newest remote step whole
    (rank 0) before reading its share: that is the bytes to allow for, not a hang."""
    layout = RunLayout.from_run_dir(run_dir)
    steps = layout.published_steps()
    if not steps:
        return _remote_restore_bytes(layout, world_size, remote)
    try:
        total = read_manifest(layout.step_dir(steps[-1])).total_bytes
    except (OSError, ManifestError, ValueError):
        return 0, True
    return total // max(world_size, 1), True


def _remote_restore_bytes(
    layout: RunLayout, world_size: int, remote: "RemoteCheckpointConfig | None"
) -> tuple[int, bool]:
    if remote is None or remote.url is None:
        return 0, False
    # boto3: only when the restore may come from the object store
    from resiliency.storage.object_retry import ObjectStoreAccessError, ObjectStoreUnavailable
    from resiliency.storage.object_store import ObjectStore
    from resiliency.storage.remote import newest_remote_bytes

    try:  # a short look: the setup timeout's base covers an answer that does not come
        store = ObjectStore(remote.url, remote.endpoint_url, workers=1, retry_budget_s=10.0)
        total = newest_remote_bytes(store, layout.run_id)
    except (ObjectStoreUnavailable, ObjectStoreAccessError) as exc:
        log.warning("ft: setup timeout not sized from the remote tier: %s", exc)
        return 0, True
    if total is None:
        return 0, False
    return total + total // max(world_size, 1), True


# ------------------------------------------------------------------ rank side
class FaultToleranceHook(TrainHook):
    """Sections for the rank monitor, learned timeouts, stack dumps, no restart on bugs."""

    def __init__(
        self,
        cfg: "FtConfig",
        env: "DistEnv",
        run_dir: Path,
        ctx: "RunContext | None",
        remote: "RemoteCheckpointConfig | None" = None,
    ) -> None:
        self.cfg, self.env, self.run_dir, self.ctx = cfg, env, run_dir, ctx
        self.remote = remote  # checkpoint.remote: a restore may download its newest step
        self.client: Any = None
        self.open: dict[str, float] = {}  # open section -> when it opened
        self.paused: list[str] = []  # sections closed while a checkpoint runs
        self.idle_since: float | None = None  # out of every section since (None: not timed)
        self.step = 0
        self.stacks: StackWatchdog | None = None
        self.heartbeats_only = False
        self.timeouts = SectionTimeouts(cfg)
        self.sent: dict[str, float] = {}  # the timeouts the rank monitor has
        self.failed = False  # this rank raised: its liveness file is kept
        self.detached = False  # the launcher closed the monitor connection: it stops us

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
        self.timeouts = SectionTimeouts(self.cfg, load_timeouts(self.run_dir))
        restore = newest_rank_bytes(self.run_dir, self.env.world_size, self.remote)
        self.timeouts.set_checkpoint_bytes(*restore)
        self._send(persist=False)
        if self.cfg.stack_dumps:
            stacks = RunLayout.from_run_dir(self.run_dir).attempts_dir / STACKS_DIR
            path = stack_path(stacks, self.env.rank, os.getpid())
            self.stacks = StackWatchdog(path, self.env.rank)
        self._open("setup")
        return run

    def on_start(self, trainer: "TrainerView") -> None:
        if self.stacks is not None and self.ctx is not None:
            self.stacks.update(attempt=self.ctx.attempt)
        self.step = trainer.state.step
        if self.heartbeats_only:
            return
        params = sum(p.numel() for chunk in trainer.parts.ddp for p in chunk.parameters())
        restore_bytes = self.timeouts.rank_bytes
        self.timeouts.set_checkpoint_bytes(max(restore_bytes, params * BYTES_PER_PARAM))
        self._send(persist=False)

    def before_step(self, trainer: "TrainerView") -> None:
        self.step = trainer.state.step + 1
        if self.heartbeats_only:
            self._tell("send_heartbeat")
            return
        if "setup" in self.open:
            self._close("setup", restored=self._restored())
        self._open("step")

    def after_step(self, trainer: "TrainerView", result: StepResult) -> None:
        if self.heartbeats_only:
            return
        self._close("step")

    def on_anomaly(self, trainer: "TrainerView", result: StepResult, action: str) -> None:
        # A rolled-back step never reaches after_step: its section ends here.
        if action in ("rollback", "replay") and not self.heartbeats_only and "step" in self.open:
            self._close("step", observe=False)

    def on_end(self, trainer: "TrainerView") -> None:
        if trainer.exit_code in exit_codes.NEVER_RETRIED:
            self._request_shutdown(f"planned exit {trainer.exit_code}")

    def on_exception(self, trainer: "TrainerView | None", exc: BaseException) -> None:
        self.failed = True  # the liveness file stays: evidence for the hang's post-mortem
        failure = classify(exc)
        if not failure.retryable:
            # ft_launcher would restart the group on any failure; a deterministic one would
            # only fail again, so ask it to stop instead.
            self._request_shutdown(f"{failure.kind}: {failure.message[:200]}")

    def close(self) -> None:
        if self.stacks is not None:
            self.stacks.close(keep=self.failed)
        if self.client is not None and self.client.is_initialized:
            self._tell("end_all_sections")
            self._tell("shutdown_workload_monitoring")

    # -- sections
    def _open(self, section: str) -> None:
        now = time.time()
        if not self.open and self.idle_since is not None:
            self.timeouts.observe(OUT_OF_SECTION, now - self.idle_since)
        self._tell("start_section", section)
        self.open[section] = now
        if self.stacks is not None:
            self.stacks.arm(section, self.sent.get(section), step=self.step)

    def _close(self, section: str, observe: bool = True, restored: bool = False) -> None:
        if self.stacks is not None:
            self.stacks.disarm()
        self._tell("end_section", section)
        opened = self.open.pop(section)
        now = time.time()
        self.idle_since = now if not self.open else None
        if observe:
            self.timeouts.observe(section, now - opened, restored=restored)
            self._send()

    def on_checkpoint_begin(self, trainer: "TrainerView", what: str) -> None:
        # Saves happen inside other sections (after a step, before one for an async commit,
        # in the preemption hook, at the end); checkpointing has its own timeout.
        self._enter("checkpointing")

    def on_checkpoint_phase(self, trainer: "TrainerView", phase: str) -> None:
        # The commit gets a full timeout of its own: a rank that stops in it must stall long
        # enough to be named, however long the wait on its writer before it took.
        if "checkpointing" in self.open and not self.heartbeats_only:
            self._close("checkpointing")
            self.idle_since = None  # not time out of section: the work goes on
            self._open("checkpointing")

    def on_checkpoint_end(self, trainer: "TrainerView", what: str) -> None:
        self._leave("checkpointing")

    def on_eval_begin(self, trainer: "TrainerView", split: str) -> None:
        self._enter("eval")

    def on_eval_end(self, trainer: "TrainerView", result: "EvalResult") -> None:
        self._leave("eval")

    def _enter(self, section: str) -> None:
        """Pause whatever is open and time ``section`` under its own timeout."""
        if self.heartbeats_only:
            return
        self.paused = list(self.open)
        for name in self.paused:
            self._close(name, observe=False)
        self.idle_since = None  # a pause is not time out of section
        self._open(section)

    def _leave(self, section: str) -> None:
        if self.heartbeats_only:
            return
        self._close(section)
        if self.paused:
            self.idle_since = None
        for name in self.paused:
            self._open(name)
        self.paused = []

    def _restored(self) -> bool:
        return self.ctx is not None and self.ctx.restored_step is not None

    # -- timeouts
    def _send(self, persist: bool = True) -> None:
        """Give the rank monitor the current timeouts when they moved; persist on rank 0."""
        current = self.timeouts.all()
        if self.sent and not moved(self.sent, current):
            return
        learned = {name for name in SECTIONS if self.timeouts.learned(name)}
        section = {
            "section": {name: current[name] for name in SECTIONS},
            "out_of_section": current[OUT_OF_SECTION],
            "calculated_sections": learned,
            "is_out_of_section_calculated": self.timeouts.learned(OUT_OF_SECTION),
        }
        self._tell("load_state_dict", {"current_timeouts": {"section": section}})
        changed = [k for k in current if self.sent.get(k) != current[k]]
        self.sent = current
        if self.env.rank != 0:
            return
        log.info(
            "ft: timeouts at step %d: %s",
            self.step,
            "; ".join(f"{k} {current[k]:.1f} s ({self.timeouts.rule(k)})" for k in changed),
        )
        if persist:
            state = {**self.timeouts.state(), "step": self.step, "time": time.time()}
            atomic_write_json(RunDir(self.run_dir).timeouts_path, state)

    def _tell(self, call: str, *args: Any) -> None:
        """One message to the rank monitor. A connection the launcher closed is not this
        rank's failure: ft_launcher closes every worker's monitor connection just before it
        stops the group (a restart, a node joining an elastic job, the end of the job) and
        SIGTERM follows, so monitoring stops for the rest of this process instead."""
        if self.detached:
            return
        try:
            getattr(self.client, call)(*args)
        except Exception as exc:
            if not _connection_closed(exc):
                raise
            self.detached = True
            socket_error = _connection_error(exc)
            log.warning(
                "ft: the launcher closed this rank's monitor connection (%s); it is stopping "
                "the worker group: section monitoring off for the rest of this process",
                type(socket_error).__name__ if socket_error else "no reply",
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


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and the exceptions it was raised from or while handling, once each."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        yield current
        seen.add(id(current))
        current = current.__cause__ or current.__context__


def _connection_error(exc: BaseException) -> BaseException | None:
    """The peer-closed socket error behind ``exc`` (nvrx raises its client error while
    handling it, so it is the context), if any."""
    closed = (BrokenPipeError, ConnectionResetError)
    return next((e for e in _chain(exc) if isinstance(e, closed)), None)


# nvrx's client reads a reply with read_obj_from_ipc_socket, which prints a socket error and
# returns None: the reset is then gone from the chain, and only this reply says so.
_NO_REPLY = "Unexpected reply: None."


def _connection_closed(exc: BaseException) -> bool:
    """nvrx's rank-monitor client failed because the other end closed the socket: the socket
    error is in the chain, or the reply nvrx read was None (it swallowed the error)."""
    if type(exc).__name__ != "RankMonitorClientError":
        return False
    return _connection_error(exc) is not None or any(_NO_REPLY in str(e) for e in _chain(exc))
