"""The loop: steps, batches, evaluation, precision, seeds, and the numeric guard (``train.*``,
``train.guard.*``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from recipes.checks import one_of, positive, require

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


@dataclass(kw_only=True)
class TrainConfig:
    train_steps: int = 20  # optimizer steps of the run (may grow on resume)
    micro_batch_size: int = 2  # samples per forward/backward per rank
    global_batch_size: int = 8  # samples per optimizer step over all data-parallel ranks
    seed: int = 1234  # model init and dropout seed
    device: str = "auto"  # auto | cpu | cuda
    precision: str = "auto"  # auto (bf16 on CUDA, fp32 on CPU) | fp32 | bf16
    # Bitwise-reproducible steps on CUDA (Megatron-LM's --deterministic-mode): megatron-core's
    # deterministic_mode, torch.use_deterministic_algorithms (warn_only: an op without a
    # deterministic kernel is named in the log, not fatal), cuDNN deterministic, and
    # CUBLAS_WORKSPACE_CONFIG=:4096:8 and NCCL_ALGO=Ring unless set. Slower; CPU runs are
    # deterministic without it.
    deterministic: bool = False
    # Validation on the held-out split every eval_interval steps (None: never) and once at the
    # end, eval_iters global batches each time; the test split too at the end if data.split
    # gives it any weight.
    eval_interval: Optional[int] = None
    eval_iters: int = 10  # validation batches per evaluation
    # Dense peak TFLOP/s per device for MFU; None: looked up for A100/H100/H200, n/a elsewhere.
    peak_tflops: Optional[float] = None
    # Seconds per training step, measured, for the planners (checkpoint.save_interval=auto and
    # the launchers' progress check); None: estimated from the model's FLOPs over launch.gpu's
    # peak at 40 % MFU.
    step_time_s: Optional[float] = None
    # A test-only fault hook ("<kind>@<step>[:rank]"); empty in every shipped recipe.
    fault: str = ""
    guard: GuardConfig = field(default_factory=GuardConfig)  # NaN/inf and loss-spike policy

    def __post_init__(self) -> None:
        positive(
            "train",
            train_steps=self.train_steps,
            micro_batch_size=self.micro_batch_size,
            global_batch_size=self.global_batch_size,
            eval_interval=self.eval_interval,
            eval_iters=self.eval_iters,
            peak_tflops=self.peak_tflops,
        )
        require(
            self.step_time_s is None or self.step_time_s > 0,
            f"train.step_time_s must be > 0 (seconds per step), got {self.step_time_s}",
        )
        require(
            self.global_batch_size % self.micro_batch_size == 0,
            f"train.global_batch_size={self.global_batch_size} must be a multiple of "
            f"train.micro_batch_size={self.micro_batch_size}",
        )
        one_of("train", "device", self.device, ("auto", "cpu", "cuda"))
        one_of("train", "precision", self.precision, ("auto", "fp32", "bf16"))
