"""What a run reports as it goes: the step line averaged over ``log_interval``, throughput in
TFLOP/s per device and MFU, memory, consumed tokens, ETA, and an end-of-run summary."""

from __future__ import annotations

import datetime
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

import psutil
import torch

from pretrain.train.hooks import StepResult

log = logging.getLogger(__name__)
GIB = float(1 << 30)


def memory_gib(device: str) -> dict[str, float]:
    """CUDA max allocated/reserved since the last call on GPU, and what stays allocated
    between steps (weights, gradient buffers, optimizer state: the planner's static part);
    the process RSS on CPU."""
    if device == "cuda":
        stats = {
            "allocated_gib": torch.cuda.memory_allocated() / GIB,
            "max_allocated_gib": torch.cuda.max_memory_allocated() / GIB,
            "max_reserved_gib": torch.cuda.max_memory_reserved() / GIB,
        }
        torch.cuda.reset_peak_memory_stats()
        return stats
    return {"rss_gib": psutil.Process().memory_info().rss / GIB}


def _fmt_duration(seconds: float) -> str:
    return str(datetime.timedelta(seconds=round(max(seconds, 0.0))))


@dataclass
class Interval:
    """Steps since the last log line."""

    steps: int = 0
    loss: float = 0.0
    grad_norm: float = 0.0
    seconds: float = 0.0

    def add(self, result: StepResult) -> None:
        self.steps += 1
        self.loss += result.loss
        self.grad_norm += result.grad_norm
        self.seconds += result.step_time_s


@dataclass
class Progress:
    """Throughput and the run's totals, on the rank that logs."""

    flops_per_step: float  # model FLOPs of one global step (pretrain/model/flops.py)
    world_size: int
    tokens_per_step: int
    total_steps: int
    peak_tflops: float | None  # per device; None: MFU is "n/a"
    device: str
    interval: Interval = field(default_factory=Interval)
    steps: int = 0
    seconds: float = 0.0
    started: float = field(default_factory=time.time)
    last_memory: dict[str, float] = field(default_factory=dict)

    def tflops(self, step_time_s: float) -> float:
        """Achieved model TFLOP/s per device for a step of ``step_time_s``."""
        return self.flops_per_step / max(step_time_s, 1e-9) / self.world_size / 1e12

    def mfu(self, tflops: float) -> float | None:
        return None if not self.peak_tflops else tflops / self.peak_tflops

    def add(self, result: StepResult) -> dict[str, Any]:
        """Per-step figures (steps.jsonl, TensorBoard), accumulated for the interval."""
        self.interval.add(result)
        self.steps += 1
        self.seconds += result.step_time_s
        tflops = self.tflops(result.step_time_s)
        return {
            "tflops_per_device": tflops,
            "mfu": self.mfu(tflops),
            "consumed_tokens": result.step * self.tokens_per_step,
        }

    def line(self, result: StepResult) -> str:
        """The step line, averaged over the interval; resets the interval."""
        iv, self.interval = self.interval, Interval()
        step_s = iv.seconds / max(iv.steps, 1)
        tflops = self.tflops(step_s)
        mfu = self.mfu(tflops)
        memory = self.last_memory = memory_gib(self.device)
        eta = (self.total_steps - result.step) * step_s
        return (
            f"step {result.step:6d}/{self.total_steps} | loss {iv.loss / max(iv.steps, 1):.6f} | "
            f"lr {result.lr:.3e} | grad norm {iv.grad_norm / max(iv.steps, 1):.4f} | "
            f"{self.tokens_per_step / step_s:.0f} tokens/s | {tflops:.2f} TFLOP/s/device | "
            f"MFU {'n/a' if mfu is None else f'{mfu:.1%}'} | "
            + " ".join(f"{k.removesuffix('_gib')} {v:.2f} GiB" for k, v in memory.items())
            + f" | {result.step * self.tokens_per_step} tokens | {step_s:.3f} s"
            f" | ETA {_fmt_duration(eta)}"
        )

    def summary(self, final: StepResult | None, validation: float | None) -> str:
        """The end-of-run lines: what was trained, how fast, where the loss ended."""
        mean_s = self.seconds / max(self.steps, 1)
        tflops = self.tflops(mean_s) if self.steps else 0.0
        mfu = self.mfu(tflops)
        parts = [
            f"run summary: {self.steps} steps this attempt"
            + (f" (to step {final.step}/{self.total_steps})" if final else ""),
            f"{self.steps * self.tokens_per_step} tokens",
            f"wall {_fmt_duration(time.time() - self.started)}",
            f"{self.tokens_per_step / mean_s if self.steps else 0:.0f} tokens/s",
            f"{tflops:.2f} TFLOP/s/device",
            f"MFU {'n/a' if mfu is None else f'{mfu:.1%}'}",
        ]
        if final is not None:
            parts.append(f"final train loss {final.loss:.6f}")
        if validation is not None and math.isfinite(validation):
            parts.append(f"validation loss {validation:.6f}")
        return " | ".join(parts)
