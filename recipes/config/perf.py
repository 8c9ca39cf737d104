"""Performance knobs: overlaps, fusions, recompute, FP8 (``perf.*``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from recipes.checks import one_of, require


@dataclass(kw_only=True)
class PerfConfig:
    # Activation recomputation (megatron's recompute_granularity): selective recomputes the
    # core attention (cheap, most of the memory at long sequences); full recomputes whole
    # layers, recompute_num_layers of them per chunk ("uniform") or the first ones ("block").
    recompute: str = "none"  # none | selective | full
    recompute_method: str = "uniform"  # uniform | block (full only)
    recompute_num_layers: int = 1  # full only
    # mcore DDP: overlap the data-parallel gradient reduce with the backward pass, and the
    # distributed optimizer's parameter all-gather with the next forward pass.
    overlap_grad_reduce: bool = False
    # overlap the distributed optimizer's param all-gather with the next forward
    overlap_param_gather: bool = False
    # Transformer Engine userbuffers: overlap TP communication with GEMMs (CUDA, TP > 1, SP).
    tp_comm_overlap: bool = False
    # FP8 through Transformer Engine (CUDA only): format and scaling recipe.
    fp8: Optional[str] = None  # None | e4m3 | hybrid
    fp8_recipe: str = "delayed"  # delayed | tensorwise | mxfp8 | blockwise

    def __post_init__(self) -> None:
        one_of("perf", "recompute", self.recompute, ("none", "selective", "full"))
        one_of("perf", "recompute_method", self.recompute_method, ("uniform", "block"))
        require(self.recompute_num_layers >= 1, "perf.recompute_num_layers must be >= 1")
        if self.fp8 is not None:
            one_of("perf", "fp8", self.fp8, ("e4m3", "hybrid"))
        recipes = ("delayed", "tensorwise", "mxfp8", "blockwise")
        one_of("perf", "fp8_recipe", self.fp8_recipe, recipes)
        require(
            not self.overlap_param_gather or self.overlap_grad_reduce,
            "perf.overlap_param_gather=true needs perf.overlap_grad_reduce=true (megatron-core)",
        )

    @property
    def needs_cuda(self) -> list[str]:
        """Settings that only Transformer Engine on a GPU implements."""
        found = []
        if self.fp8 is not None:
            found.append(f"perf.fp8={self.fp8}")
        if self.tp_comm_overlap:
            found.append("perf.tp_comm_overlap=true")
        return found
