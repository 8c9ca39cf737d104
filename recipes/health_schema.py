"""Node health checks: run on every node before training and after every restart."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from recipes.checks import require


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

    def __post_init__(self) -> None:
        require(self.min_free_gib >= 0, "resiliency.health.min_free_gib must be >= 0")
        require(self.min_shm_gib >= 0, "resiliency.health.min_shm_gib must be >= 0")
        require(self.script_timeout_s > 0, "resiliency.health.script_timeout_s must be > 0")
        require(self.allreduce_timeout_s > 0, "resiliency.health.allreduce_timeout_s must be > 0")
        require(
            self.script is None or bool(self.script.strip()),
            "resiliency.health.script must be a command or null",
        )
