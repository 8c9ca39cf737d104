"""The optimizer and its learning-rate schedule (``optimizer.*``, ``scheduler.*``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from recipes.checks import one_of, positive, require


@dataclass(kw_only=True)
class OptimizerConfig:
    name: str = "adam"  # adam (megatron-core's AdamW)
    lr: float = 3e-3  # peak learning rate
    min_lr: float = 0.0  # floor of the decay
    weight_decay: float = 0.0  # decoupled weight decay
    adam_beta1: float = 0.9  # Adam beta1
    adam_beta2: float = 0.95  # Adam beta2
    adam_eps: float = 1e-8  # Adam epsilon
    clip_grad: float = 1.0  # global gradient-norm clip; 0: off
    # shard optimizer state over data-parallel ranks (ZeRO-1)
    use_distributed_optimizer: bool = True

    def __post_init__(self) -> None:
        one_of("optimizer", "name", self.name, ("adam", "sgd"))
        require(self.lr > 0, f"optimizer.lr must be > 0, got {self.lr}")
        require(
            0 <= self.min_lr <= self.lr,
            f"optimizer.min_lr={self.min_lr} must be in [0, optimizer.lr={self.lr}]",
        )
        require(self.clip_grad >= 0, f"optimizer.clip_grad must be >= 0, got {self.clip_grad}")


@dataclass(kw_only=True)
class SchedulerConfig:
    warmup_steps: int = 0  # linear warm-up steps from 0 to optimizer.lr
    decay_steps: Optional[int] = None  # None: train.train_steps
    decay_style: str = "cosine"  # cosine | linear | constant
    start_weight_decay: Optional[float] = None  # None: optimizer.weight_decay
    end_weight_decay: Optional[float] = None  # None: start_weight_decay
    weight_decay_incr_style: str = "constant"  # constant | linear | cosine

    def __post_init__(self) -> None:
        require(self.warmup_steps >= 0, "scheduler.warmup_steps must be >= 0")
        positive("scheduler", decay_steps=self.decay_steps)
        one_of(
            "scheduler",
            "decay_style",
            self.decay_style,
            ("constant", "linear", "cosine", "inverse-square-root"),
        )
        one_of(
            "scheduler",
            "weight_decay_incr_style",
            self.weight_decay_incr_style,
            ("constant", "linear", "cosine"),
        )
