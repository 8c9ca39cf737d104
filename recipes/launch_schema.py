"""Launch configs: where and how a run is started (local, Slurm, Kubernetes)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

from recipes.checks import one_of, positive, require


@dataclass(kw_only=True)
class SlurmConfig:
    partition: Optional[str] = None
    account: Optional[str] = None
    time_limit: str = "01:00:00"
    signal_grace_s: int = 120  # --signal=B:USR1@<grace>: emergency-save window before the kill
    max_requeues: int = 3  # infrastructure retries before the job stops for good
    container_image: Optional[str] = None  # pyxis --container-image
    container_mounts: list[str] = field(default_factory=list)
    extra_sbatch: list[str] = field(default_factory=list)  # verbatim "#SBATCH" arguments
    env_passthrough: list[str] = field(default_factory=list)  # extra env vars exported to ranks

    def __post_init__(self) -> None:
        require(self.signal_grace_s >= 0, "launch.slurm.signal_grace_s must be >= 0")
        require(self.max_requeues >= 0, "launch.slurm.max_requeues must be >= 0")
        require(
            bool(re.fullmatch(r"(\d+-)?\d+(:\d{2}){0,2}", self.time_limit)),
            f"launch.slurm.time_limit={self.time_limit!r} is not a Slurm time "
            "(e.g. 04:00:00 or 2-00:00:00)",
        )


@dataclass(kw_only=True)
class K8sConfig:
    image: Optional[str] = None
    namespace: str = "default"
    job_name: Optional[str] = None  # None: derived from run_id
    shared_pvc: Optional[str] = None  # RWX claim for the persistent checkpoint tier
    shared_mount: str = "/checkpoints"
    local_volume: str = "emptyDir"  # emptyDir | hostPath: node-local checkpoint tier
    local_host_path: Optional[str] = None
    local_mount: str = "/local-ckpt"
    termination_grace_s: int = 180
    backoff_limit: int = 3
    queue: Optional[str] = None  # gang scheduling queue (Volcano/Kueue)
    priority_class: Optional[str] = None
    cpu: Optional[str] = None
    memory: Optional[str] = None
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        one_of("launch.k8s", "local_volume", self.local_volume, ("emptyDir", "hostPath"))
        require(
            self.local_volume != "hostPath" or self.local_host_path is not None,
            "launch.k8s.local_volume=hostPath needs launch.k8s.local_host_path",
        )
        require(self.termination_grace_s >= 0, "launch.k8s.termination_grace_s must be >= 0")
        require(self.backoff_limit >= 0, "launch.k8s.backoff_limit must be >= 0")


@dataclass(kw_only=True)
class LaunchConfig:
    backend: str = "torchrun"  # torchrun | ft_launcher
    nodes: int = 1
    nproc_per_node: int = 1
    gpus_per_node: int = 0
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    k8s: K8sConfig = field(default_factory=K8sConfig)

    def __post_init__(self) -> None:
        one_of("launch", "backend", self.backend, ("torchrun", "ft_launcher"))
        positive("launch", nodes=self.nodes, nproc_per_node=self.nproc_per_node)
        require(self.gpus_per_node >= 0, "launch.gpus_per_node must be >= 0")
        require(
            self.gpus_per_node in (0, self.nproc_per_node),
            f"launch.gpus_per_node={self.gpus_per_node} must be 0 (CPU) or equal "
            f"launch.nproc_per_node={self.nproc_per_node} (one rank per GPU)",
        )

    @property
    def world_size(self) -> int:
        return self.nodes * self.nproc_per_node
