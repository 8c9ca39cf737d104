"""Checkpointing: the persistent tier and its resume rules, the node-local tier and the object-store
tier (``checkpoint.*``, ``checkpoint.local.*``, ``checkpoint.remote.*``)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

from recipes.checks import one_of, positive, require


@dataclass(kw_only=True)
class LocalCheckpointConfig:
    """Node-local tier (nvidia-resiliency-ext), replicated to peers on other nodes."""

    interval: int | None = None  # steps between local saves; None: tier off
    dir: str | None = None  # node-local disk; each node writes <dir>/node-<node_rank>/<run_id>
    replication_factor: int = 2  # copies of each rank's shard, on distinct nodes; 1: no replicas
    replication_jump: int | None = None  # rank distance between copies; None: ranks per node
    keep_last: int = 2  # local steps kept per node

    @property
    def enabled(self) -> bool:
        return self.interval is not None

    def __post_init__(self) -> None:
        positive("checkpoint.local", interval=self.interval, replication_jump=self.replication_jump)
        require(
            self.interval is None or bool(self.dir),
            "checkpoint.local.interval is set but checkpoint.local.dir is not: give the "
            "node-local directory, e.g. checkpoint.local.dir=/local_nvme/ckpt",
        )
        require(self.replication_factor >= 1, "checkpoint.local.replication_factor must be >= 1")
        require(self.keep_last >= 1, "checkpoint.local.keep_last must be >= 1")


@dataclass(kw_only=True)
class RemoteCheckpointConfig:
    """Object-store tier: committed steps copied to S3 by an independent uploader
    (``python -m resiliency upload``), restored from when no local or shared step verifies."""

    url: str | None = None  # s3://bucket/prefix; None: tier off. Objects: <prefix>/<run_id>/...
    endpoint_url: str | None = None  # S3-compatible server (SeaweedFS, MinIO...); None: AWS
    keep_last: int = 3  # remote steps kept that verified remotely (plus milestones); >= 2
    workers: int = 8  # objects uploaded or downloaded in parallel
    follow_interval_s: float = 10.0  # how often the launchers' uploader looks for new steps
    # Transient errors (timeouts, resets, 5xx, throttling) are retried with backoff this long
    # per call; then a restore fails as infrastructure (exit 1, retried by the launchers).
    retry_budget_s: float = 120.0
    # The launch-time probe refuses a server that ignores If-None-Match / If-Match; true
    # accepts it (steps could then be overwritten and latest.json moved backwards).
    allow_unconditional: bool = False

    @property
    def enabled(self) -> bool:
        return self.url is not None

    def __post_init__(self) -> None:
        require(
            self.url is None or (self.url.startswith("s3://") and len(self.url) > 5),
            f"checkpoint.remote.url={self.url!r}: give s3://bucket[/prefix]",
        )
        require(
            self.keep_last >= 2,
            f"checkpoint.remote.keep_last={self.keep_last}: keep at least 2 remote steps (a "
            "step found bad at restore needs an older one to fall back to)",
        )
        require(self.retry_budget_s > 0, "checkpoint.remote.retry_budget_s must be > 0")
        positive("checkpoint.remote", workers=self.workers)
        require(self.follow_interval_s > 0, "checkpoint.remote.follow_interval_s must be > 0")


INIT_LOADS = ("weights", "weights+optimizer")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(kw_only=True)
class CheckpointConfig:
    enabled: bool = True  # save and restore at all
    # Steps between persistent saves; None: only at the end; "auto": Young's interval
    # sqrt(2 x save time x MTBF) in steps, from the planner's step time (train.step_time_s, or
    # estimated for launch.gpu) and a save of the checkpoint's bytes at plan_bandwidth
    # (pretrain/fit/timing.py). A launcher pins the number it resolves in the job's config.
    save_interval: Optional[int | str] = None
    # What "auto" and the launchers' progress check plan with: the job's aggregate checkpoint
    # write rate (GB/s) and one GPU's mean time between failures (hours; the job's MTBF is it
    # over the GPU count). 50,000 h: Llama 3 405B saw 419 unexpected interruptions in 54 days
    # on 16,384 H100s (Dubey et al. 2024, section 3.3.4).
    plan_bandwidth: float = 10.0
    plan_gpu_mtbf_h: float = 50000.0  # one GPU's MTBF in hours (the job's: this / its GPUs)
    # fully_reshardable (any layout) | dp_reshardable (faster, same TP/PP)
    optim_format: str = "fully_reshardable"
    async_save: bool = False  # write in a background process; published at a later step boundary
    # Keep a host copy of the checkpointed state between saves and save from it: saves skip
    # page faults on fresh memory (and async saves need no fork). Costs host memory equal to
    # the rank's checkpoint bytes.
    staging_buffers: bool = True
    # Shard files each rank writes in parallel (megatron's thread_count). On one local disk
    # one sequential stream per rank was fastest; parallel file systems may want more.
    writer_threads: int = 1
    resume: bool = True  # restore the newest verified step at start
    load_optimizer: bool = True  # restore optimizer state too (false: weights only)
    keep_last: int = 2  # published steps kept (older ones collected)
    # steps whose checkpoints are never collected; None: none
    milestone_interval: Optional[int] = None
    full_verify: bool = True  # checksum every byte at restore, not only sizes (pickles: always)
    # At process start, before torch is imported, read this rank's share of the newest
    # published step into the page cache on a background thread, so the disk works while the
    # process imports and builds the model; skipped where the host's shares would take more
    # than half its available memory. The restore still checks every byte it reads.
    prefetch: bool = True
    lease_timeout_s: float = 60.0  # a run dir's lease is stale after this long without a heartbeat
    # Restoring with a different train.global_batch_size: refuse, or scale the LR by this rule.
    batch_change_lr_scaling: str = "refuse"
    # Resuming with other optimizer/scheduler values than the checkpoint's: refuse, keep the
    # checkpoint's ("checkpoint") or apply the new ones ("config"); see
    # checkpoint/restore/resume_policy.py.
    schedule_on_resume: str = "refuse"
    # The run dir has published steps but none verifies: refuse (exit 10), or start the run's
    # history over from step 0 (the bad steps are set aside as they are overwritten).
    start_over_if_unverified: bool = False
    # The name of an environment variable holding a key: every published step then carries an
    # HMAC-SHA256 of its manifest, and a restore from any tier rejects a step whose signature
    # is missing or wrong. Set the variable on every rank. None: no signatures.
    signing_key_env: Optional[str] = None
    # Record a fingerprint of each rank's live model and optimizer tensors with every save and
    # check it after a restore on the same layout (refused, exit 10, if any tensor differs):
    # the run continues from exactly the saved state. One extra read of the state per save.
    fingerprint: bool = False
    # Warm start (Megatron-LM's --pretrained-checkpoint, Megatron-Bridge's
    # checkpoint.pretrained_checkpoint): a run with no step of its own starts from another
    # run's weights. A step dir, a run dir (its newest verified step), an s3:// run prefix
    # (its newest remote step), or the run dir `resiliency.hf import` wrote. Used only while
    # this run has no published step: a relaunch resumes its own steps.
    # restore/init_source.py; docs/checkpoints.md#warm-start.
    init_from: Optional[str] = None
    # What of init_from is loaded: weights (a fresh optimizer) or weights+optimizer (Adam's
    # moments too). Either way step, data cursor, schedule and RNG are this run's, from 0.
    init_load: str = "weights"
    # The resume-equivalence gate's probe (python -m drill.equivalence; docs/checkpoints.md,
    # "Proving a resume exact"): at each listed step, before the next one trains, every rank
    # writes its whole state (parameters, main parameters, optimizer state, the last step's
    # gradients, schedule, RNG streams, data cursor) to <dump_state_dir>/step-<N>/rank-<R>.pt.
    # Empty: never.
    dump_state_at: list[int] = field(default_factory=list)
    # Where checkpoint.dump_state_at writes (a directory per run compared; needed with it).
    dump_state_dir: Optional[str] = None
    local: LocalCheckpointConfig = field(default_factory=LocalCheckpointConfig)
    remote: RemoteCheckpointConfig = field(default_factory=RemoteCheckpointConfig)

    def __post_init__(self) -> None:
        one_of(
            "checkpoint", "optim_format", self.optim_format, ("fully_reshardable", "dp_reshardable")
        )
        require(
            self.save_interval in (None, "auto")
            or (isinstance(self.save_interval, int) and self.save_interval >= 1),
            f"checkpoint.save_interval={self.save_interval!r}: give a number of steps (>= 1), "
            "auto (Young's interval from the planner) or null (only at the end)",
        )
        require(
            self.plan_bandwidth > 0 and self.plan_gpu_mtbf_h > 0,
            "checkpoint.plan_bandwidth (GB/s) and checkpoint.plan_gpu_mtbf_h (hours) must be > 0",
        )
        positive(
            "checkpoint",
            milestone_interval=self.milestone_interval,
            writer_threads=self.writer_threads,
        )
        require(
            self.keep_last >= 2,
            f"checkpoint.keep_last={self.keep_last}: at least 2 verified steps are kept, so a "
            "corrupt newest step always has a fallback",
        )
        require(self.lease_timeout_s > 0, "checkpoint.lease_timeout_s must be > 0")
        require(
            self.signing_key_env is None or _ENV_NAME.fullmatch(self.signing_key_env) is not None,
            f"checkpoint.signing_key_env={self.signing_key_env!r}: give the name of an "
            "environment variable holding the key (e.g. CKPT_SIGNING_KEY), not the key itself",
        )
        one_of(
            "checkpoint",
            "batch_change_lr_scaling",
            self.batch_change_lr_scaling,
            ("refuse", "none", "linear", "sqrt"),
        )
        one_of("checkpoint", "init_load", self.init_load, INIT_LOADS)
        require(
            self.init_from is None or self.enabled,
            "checkpoint.init_from needs checkpoint.enabled=true: the warm start is a restore "
            "(drop checkpoint.enabled=false, or checkpoint.init_from)",
        )
        require(
            self.init_from is None or bool(self.init_from.strip()),
            "checkpoint.init_from is empty: give a step dir, a run dir or s3://bucket/prefix/"
            "<run_id>, or null",
        )
        require(
            not self.dump_state_at or bool(self.dump_state_dir),
            "checkpoint.dump_state_at needs checkpoint.dump_state_dir (where each rank writes "
            "its state), e.g. checkpoint.dump_state_dir=/tmp/dumps/reference",
        )
        require(
            all(isinstance(s, int) and s >= 0 for s in self.dump_state_at),
            f"checkpoint.dump_state_at={self.dump_state_at!r}: give step numbers (>= 0)",
        )
        one_of(
            "checkpoint",
            "schedule_on_resume",
            self.schedule_on_resume,
            ("refuse", "checkpoint", "config"),
        )
