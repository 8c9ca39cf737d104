"""The checkpoint tiers beside the shared one: node-local with replicas, and the object store
(``checkpoint.local.*``, ``checkpoint.remote.*``)."""

from __future__ import annotations

from dataclasses import dataclass

from recipes.checks import positive, require


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
