"""The gate's controls: restores broken on purpose (train.fault=break_*, resiliency/checkpoint/
restore/broken.py), each of which the comparison must catch by name. A gate never shown to fail
proves nothing (Megatron-LM PR #7421)."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from resiliency.checkpoint.equivalence.compare import Difference


@dataclass(frozen=True)
class Control:
    name: str
    kind: str  # the train.fault kind
    on_last_rank: bool  # on the resumed run's last rank (else rank 0)
    caught_by: str  # the state key the comparison must name (a glob)
    rng: bool = False  # an RNG stream: not compared across a DP change (reseeded there)

    def rank(self, world: int) -> int:
        return world - 1 if self.on_last_rank else 0

    def fault(self, step: int, world: int) -> str:
        return f"{self.kind}@{step}:{self.rank(world)}"

    def caught(self, differences: list[Difference], step: int, world: int, exact: bool) -> str:
        """The first difference that names this control's state (on its rank when the layout
        is the same; anywhere across a DP change), or ''."""
        where = f"rank {self.rank(world)}"
        for difference in differences:
            if difference.step != step or not fnmatch.fnmatch(difference.name, self.caught_by):
                continue
            if not exact or difference.where == where:
                return str(difference)
        return ""


CONTROLS = (
    Control("rng_python", "break_rng_python", False, "rng/python", rng=True),
    Control("rng_numpy", "break_rng_numpy", True, "rng/numpy", rng=True),
    Control("rng_torch", "break_rng_torch", False, "rng/torch", rng=True),
    Control(
        "rng_expert_parallel", "break_rng_ep", True, "rng/tracker/expert-parallel-rng", rng=True
    ),
    Control("adam_step", "break_adam_step", False, "optimizer/*/step"),
    Control("data_cursor", "break_data_cursor", True, "loop/consumed_samples"),
    Control("param", "break_param", True, "model/*"),
)
