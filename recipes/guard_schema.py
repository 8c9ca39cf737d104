"""The numeric guard (``train.guard``): what a non-finite loss or gradient, or a loss spike, does
to a run. The default (stop, no spike rule) is the behaviour without a guard."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from recipes.checks import one_of, require

POLICIES = ("stop", "skip", "rollback", "replay")


@dataclass(kw_only=True)
class GuardConfig:
    # stop fails the run (exit 5, not retried); skip drops that step's update (step counter and
    # data cursor advance, the LR schedule does not, as in Megatron-LM); rollback restores the
    # last verified persistent checkpoint in place and skips every batch since it, the bad one
    # too, at most max_rollbacks times per run; replay restores it the same way but trains the
    # same batches again (a transient fault, e.g. a silent data corruption, does not recur:
    # Megatron-LM's rerun state machine draws the same line) and rolls back as rollback does
    # only if the anomaly recurs at the same step; replays count against max_rollbacks.
    policy: str = "stop"  # stop | skip | rollback | replay: what a NaN/inf or a spike does
    # A loss spike is a loss above mean + spike_sigma x std of the last spike_window losses
    # (OLMo-core's skip-step rule: 6 over 128); null: only non-finite values count.
    spike_sigma: Optional[float] = None
    spike_window: int = 128  # losses the spike statistics cover (no verdict until it is full)
    max_rollbacks: int = 3  # rollbacks per run; the next anomaly stops the run (exit 5)

    def __post_init__(self) -> None:
        one_of("train.guard", "policy", self.policy, POLICIES)
        require(
            self.spike_sigma is None or self.spike_sigma > 0,
            f"train.guard.spike_sigma must be > 0 or null, got {self.spike_sigma}",
        )
        require(
            self.spike_window >= 2,
            f"train.guard.spike_window must be >= 2 (a standard deviation needs two losses), "
            f"got {self.spike_window}",
        )
        require(
            self.max_rollbacks >= 1 or self.policy not in ("rollback", "replay"),
            f"train.guard.policy={self.policy} needs train.guard.max_rollbacks >= 1",
        )
        require(self.max_rollbacks >= 0, "train.guard.max_rollbacks must be >= 0")
