"""The parallel layout: TP, PP, VPP, CP, EP and the sequence/context options (``parallel.*``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from recipes.checks import positive, require


@dataclass(kw_only=True)
class ParallelConfig:
    tp: int = 1  # tensor-parallel size
    pp: int = 1  # pipeline-parallel size
    vpp: Optional[int] = None  # virtual pipeline stages per pipeline rank (interleaved 1F1B)
    cp: int = 1  # context-parallel size (CUDA only: Transformer Engine attention)
    ep: int = 1  # expert-parallel size (MoE)
    dp: Optional[int] = None  # None: derived from the world size
    # shard activations along the sequence in TP regions (needs tp > 1)
    sequence_parallel: bool = False
    # Elastic data parallelism (docs/fault-tolerance.md): a lost node leaves the job training
    # at a smaller DP (down to launch.min_nodes) with the same global batch, sample order and
    # LR schedule, and a returning node grows it back. Needs launch.backend=ft_launcher,
    # checkpoint.optim_format=fully_reshardable and parallel.dp=null.
    elastic: bool = False
    # a returning node joins no sooner than this after the group last re-formed (a lost node
    # shrinks the group at once)
    elastic_min_interval_s: float = 300.0

    def __post_init__(self) -> None:
        positive(
            "parallel", tp=self.tp, pp=self.pp, vpp=self.vpp, cp=self.cp, ep=self.ep, dp=self.dp
        )
        require(
            not self.sequence_parallel or self.tp > 1,
            "parallel.sequence_parallel=true needs parallel.tp > 1",
        )
        require(
            self.elastic_min_interval_s >= 0,
            f"parallel.elastic_min_interval_s={self.elastic_min_interval_s} must be >= 0",
        )
        require(
            not self.elastic or self.dp is None,
            f"parallel.elastic=true resizes DP: parallel.dp={self.dp} must be null (derived "
            "from the world size at each size)",
        )
        require(
            self.vpp is None or self.pp > 1,
            f"parallel.vpp={self.vpp} needs parallel.pp > 1 (interleaving needs stages)",
        )

    def layout(self, dp: int) -> dict[str, int]:
        """The layout as recorded in checkpoint manifests (vpp 1 = not interleaved)."""
        return {
            "tp": self.tp,
            "pp": self.pp,
            "vpp": self.vpp or 1,
            "cp": self.cp,
            "ep": self.ep,
            "dp": dp,
        }

    @property
    def model_parallel_size(self) -> int:
        return self.tp * self.pp * self.cp

    def data_parallel_size(self, world_size: int) -> int:
        """The DP size for ``world_size`` ranks, or a ConfigError naming the mismatch."""
        mp = self.model_parallel_size
        require(
            world_size % mp == 0,
            f"world size {world_size} is not divisible by tp*pp*cp = "
            f"{self.tp}*{self.pp}*{self.cp} = {mp}",
        )
        dp = world_size // mp
        require(
            self.dp is None or self.dp == dp,
            f"parallel.dp={self.dp} but tp*pp*cp*dp must equal the world size {world_size}: "
            f"dp would be {dp} (set parallel.dp=null to derive it)",
        )
        require(
            (dp * self.cp) % self.ep == 0,
            f"parallel.ep={self.ep} must divide dp*cp = {dp}*{self.cp}",
        )
        return dp
