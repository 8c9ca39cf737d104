"""Fault tolerance around the loop: ft_launcher sections, stragglers, metrics, the post-restore
watch, node health (``resiliency.*``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from recipes.checks import positive, require


@dataclass(kw_only=True)
class HealthConfig:
    enabled: bool = True  # check every node before training and after every restart
    # Free space under output_dir (the checkpoint tier) and the local tier's dir: a save that
    # cannot fit fails minutes later, after the step's work is lost.
    min_free_gib: float = 1.0
    # /dev/shm holds the async writer's staging buffers and DataLoader worker batches; Docker's
    # and many pods' default is 64 MiB.
    min_shm_gib: float = 0.0
    # A site check (e.g. `dcgmi diag -r 1`, a filesystem probe): run on every node with the
    # node's name in $MCORE_RECIPES_NODE; non-zero exit = the node is unhealthy.
    script: Optional[str] = None
    script_timeout_s: float = 300.0  # the site script's time limit
    # One all-reduce over every rank after the process group is up: a dead link or a stuck
    # peer fails the attempt now, as infrastructure, instead of the first step hanging.
    allreduce_timeout_s: float = 120.0
    # The run dir's storage must answer a small write and fsync within this, before every
    # launch and after every failure the launcher reports; if it does not (a hung NFS, Lustre
    # or FUSE mount), launch local gives the node up: exit 14 (NODE_UNHEALTHY).
    storage_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        require(self.min_free_gib >= 0, "resiliency.health.min_free_gib must be >= 0")
        require(self.min_shm_gib >= 0, "resiliency.health.min_shm_gib must be >= 0")
        require(self.script_timeout_s > 0, "resiliency.health.script_timeout_s must be > 0")
        require(self.allreduce_timeout_s > 0, "resiliency.health.allreduce_timeout_s must be > 0")
        require(self.storage_timeout_s > 0, "resiliency.health.storage_timeout_s must be > 0")
        require(
            self.script is None or bool(self.script.strip()),
            "resiliency.health.script must be a command or null",
        )


@dataclass(kw_only=True)
class FtConfig:
    """Hang detection by nvidia-resiliency-ext rank monitors (launch.backend=ft_launcher)."""

    # Timeouts before a section has been observed (resiliency/monitor/timeouts.py). Setup
    # (model build, data, restore) and checkpointing also get this rank's checkpoint bytes at
    # min_io_mb_per_s on top: a bound from what is known rather than one fixed 15 minutes.
    setup_timeout_s: float = 600.0
    step_timeout_s: float = 600.0  # prior timeout of a training step (before learned)
    eval_timeout_s: float = 600.0  # prior timeout of a validation pass
    # prior timeout of a save or restore, plus bytes / min_io_mb_per_s
    checkpointing_timeout_s: float = 60.0
    out_of_section_timeout_s: float = 600.0  # prior timeout between sections (data loading, hooks)
    min_io_mb_per_s: float = 50.0  # conservative per-rank checkpoint write/read bandwidth
    # Once observed: timeout_multiplier x the section's p99, never below timeout_floor_s. With
    # 3 x p99 and 30 s a hung rank is torn down within max(3 x p99, 30 s) + a check interval.
    learn_timeouts: bool = True
    learn_after_steps: int = 10  # steps (and out-of-section gaps) before those two are learned
    timeout_multiplier: float = 3.0  # learned timeout = max(multiplier x p99, floor)
    timeout_floor_s: float = 30.0  # lowest learned timeout
    check_interval_s: float = 1.0  # how often the rank monitor checks
    # ft_launcher's SIGTERM -> SIGKILL grace when it stops a failed group to restart it: a
    # peer is gone, so no collective save can finish and a hung rank ignores SIGTERM; a long
    # grace only delays the restart (nvrx's own default: 30 s on 0.4, 15 s on 0.7).
    workers_stop_timeout_s: float = 10.0
    # Dump every rank's Python stacks shortly before its section times out, and keep a
    # per-rank liveness heartbeat (evidence: which rank hung or stopped, which only waited).
    stack_dumps: bool = True

    def __post_init__(self) -> None:
        for key in (
            "setup_timeout_s",
            "step_timeout_s",
            "eval_timeout_s",
            "checkpointing_timeout_s",
            "min_io_mb_per_s",
            "out_of_section_timeout_s",
            "timeout_floor_s",
            "check_interval_s",
            "workers_stop_timeout_s",
        ):
            require(getattr(self, key) > 0, f"resiliency.ft.{key} must be > 0")
        require(self.timeout_multiplier >= 1, "resiliency.ft.timeout_multiplier must be >= 1")
        positive("resiliency.ft", learn_after_steps=self.learn_after_steps)


@dataclass(kw_only=True)
class StragglerConfig:
    """Straggler reports from nvidia-resiliency-ext's Detector (sections; CUDA kernels on GPU)."""

    enabled: bool = False  # time every rank's steps and report slow ones
    report_interval: int = 20  # steps between reports
    warmup_steps: int = 5  # first steps of every attempt are not timed (allocator, caches)
    # A rank whose score (best rank's time / its time) is below this is named a straggler.
    relative_threshold: float = 0.6
    individual_threshold: float = 0.7  # vs the rank's own best: logged, not a straggler alone
    stop_if_detected: bool = False  # save and exit STRAGGLER

    def __post_init__(self) -> None:
        positive("resiliency.straggler", report_interval=self.report_interval)
        require(self.warmup_steps >= 0, "resiliency.straggler.warmup_steps must be >= 0")
        for key in ("relative_threshold", "individual_threshold"):
            require(0 < getattr(self, key) < 1, f"resiliency.straggler.{key} must be in (0, 1)")


@dataclass(kw_only=True)
class MetricsConfig:
    """Prometheus metrics: <run_dir>/metrics/metrics.prom (rank 0), optionally served over HTTP."""

    enabled: bool = True  # Prometheus text metrics in <run_dir>/metrics
    write_interval_steps: int = 10  # steps between metric file writes
    http_port: int = 0  # 0: no HTTP endpoint

    def __post_init__(self) -> None:
        positive("resiliency.metrics", write_interval_steps=self.write_interval_steps)
        require(0 <= self.http_port < 65536, "resiliency.metrics.http_port must be in [0, 65535]")


@dataclass(kw_only=True)
class WatchConfig:
    """After a restore, compare loss and grad norm with the values logged before the failure."""

    steps: int = 10  # 0: off
    loss_tolerance: float = 0.1  # relative increase that counts as a jump
    grad_norm_tolerance: float = 1.0  # relative grad-norm increase that counts as a jump
    stop_on_jump: bool = False  # fail the run (numeric, not retried) instead of only logging

    def __post_init__(self) -> None:
        require(self.steps >= 0, "resiliency.watch.steps must be >= 0")
        require(
            self.loss_tolerance > 0 and self.grad_norm_tolerance > 0,
            "resiliency.watch tolerances must be > 0",
        )


@dataclass(kw_only=True)
class ResiliencyConfig:
    # SIGTERM / SIGUSR1 -> emergency persistent save at the next step boundary -> exit REQUEUE.
    preemption: bool = True
    emergency_save_timeout_s: float = 120.0  # an emergency save longer than this is abandoned
    # Restarts after infrastructure failures (python -m launch local); other failures stop.
    max_restarts: int = 2
    ft: FtConfig = field(default_factory=FtConfig)
    straggler: StragglerConfig = field(default_factory=StragglerConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    watch: WatchConfig = field(default_factory=WatchConfig)
    health: HealthConfig = field(default_factory=HealthConfig)

    def __post_init__(self) -> None:
        require(
            self.emergency_save_timeout_s > 0, "resiliency.emergency_save_timeout_s must be > 0"
        )
        require(self.max_restarts >= 0, "resiliency.max_restarts must be >= 0")
