"""The numeric guard (``train.guard``): a non-finite loss or gradient, or a loss spike, and the
policy that answers it (stop, skip the update, roll back to the last verified checkpoint and
skip the data since, or replay that data and roll back only if the anomaly recurs).

The guard judges a step after its forward/backward pass and before the optimizer step, from
values every rank already agrees on: the loss all-reduce carries a non-finite-gradient flag,
and the spike statistics are computed from the same reduced losses on every rank. So every
rank takes the same decision without a collective of its own.

Spike rule: loss > mean + ``spike_sigma`` x std (sample std) of the last ``spike_window``
finite losses, skipped ones included, as OLMo-core's ``SkipStepOptimizer`` (6 sigma over 128
steps, used for OLMo 2; one-sided here: a sudden drop is not a problem). A lone spike in the
window raises the std so that an equal second spike still scores about sqrt(window) sigma,
while a lasting level shift is absorbed after a few steps instead of skipping every step.
Megatron-LM's ``--check-for-spiky-loss`` flags a loss above 10x the max of the first 100
losses: a detector for hardware faults (a flipped exponent bit) that never fires on the 2-3x
optimisation spikes that large runs skip or roll back.

The guard's state (the loss window, run totals) is saved with every checkpoint, so a resumed
run judges its steps exactly as the uninterrupted run would have.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from typing import TYPE_CHECKING, Any

import torch

from pretrain.context.failures import NonFiniteError

if TYPE_CHECKING:
    from pretrain.train.hooks import StepResult
    from recipes.config.train import GuardConfig

log = logging.getLogger(__name__)

NON_FINITE_GRADS = "non-finite gradients"
MAX_EVENTS = 100  # guard events kept for the attempt record (the totals count every one)


class LossSpikeError(NonFiniteError):
    """A loss spike under ``train.guard.policy=stop`` (or with no rollback left): numeric,
    not retried, like a non-finite loss."""


class SpikeWindow:
    """The last ``size`` finite losses and the threshold they set for the next one."""

    def __init__(self, sigma: float, size: int) -> None:
        self.sigma = sigma
        self.losses: deque[float] = deque(maxlen=size)

    def limit(self) -> tuple[float, float, float] | None:
        """(threshold, mean, std); None until the window is full."""
        n = len(self.losses)
        if n < (self.losses.maxlen or 0):
            return None
        mean = math.fsum(self.losses) / n
        std = math.sqrt(math.fsum((x - mean) ** 2 for x in self.losses) / (n - 1))
        return mean + self.sigma * std, mean, std

    def judge(self, loss: float) -> str | None:
        """Why ``loss`` is a spike, or None; then ``loss`` joins the window."""
        found = self.limit()
        verdict = None
        if found is not None and loss > found[0]:
            limit, mean, std = found
            verdict = (
                f"loss spike: {loss:.6g} > {limit:.6g} (mean {mean:.6g} + {self.sigma:g} x std "
                f"{std:.6g} of the last {len(self.losses)} losses)"
            )
        self.losses.append(loss)
        return verdict


def nonfinite_grads(ddp_chunks: list[Any]) -> torch.Tensor:
    """1.0 if any of this rank's gradient buffers holds a NaN or inf, else 0.0 (no host sync).

    One sum per buffer: NaN and inf propagate through it (inf - inf is NaN), and a finite
    buffer's sum overflows only past 3e38. After the backward pass every buffer holds either
    this rank's reduced shard or its own unreduced gradients, so a non-finite value on any
    rank shows on at least one rank; the loss all-reduce then tells every rank.
    """
    sums = [
        buffer.grad_data.sum(dtype=torch.float32)
        for chunk in ddp_chunks
        for buffer in [*chunk.buffers, *getattr(chunk, "expert_parallel_buffers", [])]
    ]
    if not sums:
        return torch.zeros((), dtype=torch.float64)
    return (~torch.isfinite(torch.stack(sums).sum())).to(torch.float64)


class NumericGuard:
    """Judges each step (when active), picks the policy's action and keeps the run's totals;
    the Trainer carries the action out (it owns the optimizer, the scheduler and the data
    cursor: ``Trainer._answer_anomaly``)."""

    def __init__(self, cfg: GuardConfig) -> None:
        self.cfg = cfg
        self.window = (
            SpikeWindow(cfg.spike_sigma, cfg.spike_window) if cfg.spike_sigma is not None else None
        )
        # Judged before the optimizer step only when something can come of it: a policy other
        # than stop, or a spike rule. Otherwise the loop's check after the step is all there is.
        self.active = cfg.policy != "stop" or self.window is not None
        self.checks_grads = cfg.policy != "stop"
        self.skipped_steps = 0  # run totals: restored with checkpoints, never rolled back
        self.rollbacks = 0
        self.skipped_samples = 0
        self.replayed: set[int] = set()  # steps replayed in this process (replay policy)
        self.events: list[dict[str, Any]] = []  # this attempt's, for the attempt record

    def inspect(self, loss: float, grads_nonfinite: bool) -> str | None:
        """Before the optimizer step: why this step's update must not be applied, or None."""
        if not math.isfinite(loss):
            return f"non-finite loss {loss}"
        verdict = self.window.judge(loss) if self.window is not None else None
        if grads_nonfinite:
            return NON_FINITE_GRADS
        return verdict

    def action(self, result: StepResult) -> str:
        """stop | skip | rollback | replay for a step with an anomaly. An update that was applied
        (the anomaly showed only after the step) cannot be skipped, only rolled back. A step
        that was replayed and failed again is the data's fault: it is rolled back past."""
        policy = self.cfg.policy
        if policy == "skip" and not result.skipped:
            return "stop"
        if policy in ("rollback", "replay") and self.rollbacks >= self.cfg.max_rollbacks:
            return "stop"
        if policy == "replay" and result.step in self.replayed:
            return "rollback"
        return policy

    def stop_error(self, result: StepResult) -> NonFiniteError:
        if result.anomaly is not None and result.anomaly.startswith("loss spike"):
            return LossSpikeError(
                f"step {result.step}: {result.anomaly}; {self._budget()}not retrying a numeric "
                "failure"
            )
        return NonFiniteError(
            f"step {result.step}: loss {result.loss}, grad norm {result.grad_norm}; "
            f"{self._budget()}not retrying a numeric failure"
        )

    def _budget(self) -> str:
        if self.cfg.policy in ("rollback", "replay") and self.rollbacks >= self.cfg.max_rollbacks:
            return f"train.guard.max_rollbacks={self.cfg.max_rollbacks} spent; "
        return ""

    def skipped(self, result: StepResult, samples: int) -> None:
        self.skipped_steps += 1
        self.skipped_samples += samples
        self._event(result, "skip")

    def rolled_back(
        self, result: StepResult, restored: int, window: tuple[int, int], action: str
    ) -> None:
        """Step ``result.step`` rolled back to ``restored``; samples [start, end) skipped (an
        empty window: replayed)."""
        self.rollbacks += 1
        self.skipped_samples += window[1] - window[0]
        if action == "replay":
            self.replayed.add(result.step)
        self._event(result, action, restored_step=restored, skipped_samples=list(window))

    def roll_back_error(self, result: StepResult, action: str) -> NonFiniteError:
        """No hook had a verified checkpoint to roll back to."""
        self.stopped(result)
        return NonFiniteError(
            f"step {result.step}: {result.anomaly}; train.guard.policy={action} found no "
            "verified checkpoint to roll back to (it needs checkpoint.enabled=true and a "
            "save before the anomaly); not retrying a numeric failure"
        )

    def stopped(self, result: StepResult) -> None:
        self._event(result, "stop")

    def _event(self, result: StepResult, action: str, **extra: Any) -> None:
        event = {"step": result.step, "action": action, "anomaly": result.anomaly}
        event.update(loss=_json_float(result.loss), grad_norm=_json_float(result.grad_norm))
        self.events = [*self.events, {**event, **extra}][-MAX_EVENTS:]

    def record(self) -> dict[str, Any]:
        """For the attempt record: run totals and this attempt's events."""
        return {
            "policy": self.cfg.policy,
            "skipped_steps": self.skipped_steps,
            "rollbacks": self.rollbacks,
            "skipped_samples": self.skipped_samples,
            "events": self.events,
        }

    def state_dict(self) -> dict[str, Any]:
        """Saved with every checkpoint (train_state.json)."""
        return {
            "losses": list(self.window.losses) if self.window is not None else [],
            "skipped_steps": self.skipped_steps,
            "rollbacks": self.rollbacks,
            "skipped_samples": self.skipped_samples,
        }

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """From a checkpoint (None: saved before the guard existed). The loss window is the
        checkpoint's; the totals never go back (an in-process rollback keeps its count)."""
        if state is None:
            return
        if self.window is not None:
            self.window.losses.clear()
            self.window.losses.extend(state.get("losses", []))
        for key in ("skipped_steps", "rollbacks", "skipped_samples"):
            setattr(self, key, max(getattr(self, key), int(state.get(key, 0))))


def _json_float(value: float) -> float | str:
    """NaN and inf as strings: the attempt record is strict JSON."""
    return value if math.isfinite(value) else str(value)
