"""Post-restore watch: a restored run must pick up where it left off, not just run.

For the first ``resiliency.watch.steps`` steps after a restore, each step's loss and grad norm
are compared with the values ``metrics/steps.jsonl`` holds from before the failure: the same
step if it was done then (an exact resume reproduces it), else the highest value of the last
``RECENT`` steps logged before the failure (one step's loss varies by more than the tolerance
from the next on small batches: a single step as the yardstick cried wolf on normal resumes).
An increase beyond the relative tolerance is logged as an error on rank 0 and recorded in the
attempt record; with ``stop_on_jump`` the run fails as a numeric failure (not retried,
nothing saved). Loss and grad norm are global values, identical on every rank, so every rank
reaches the same verdict without communicating.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pretrain.context.failures import NonFiniteError
from pretrain.context.run_dir import RunDir, last_by_step
from pretrain.train.hooks import StepResult, TrainHook

if TYPE_CHECKING:
    from pretrain.train.view import TrainerView
    from recipes.config.resiliency import WatchConfig
    from resiliency.run_context import RunContext

log = logging.getLogger(__name__)
RECENT = 10  # steps before the failure whose peak a step beyond it is compared with


class RestoreDivergedError(NonFiniteError):
    """Loss or grad norm jumped right after a restore: the restored state is suspect."""


def read_history(run_dir: Path) -> dict[int, dict[str, Any]]:
    """step -> the last record logged for it (a step redone after a restart keeps the last)."""
    return last_by_step(RunDir(run_dir).steps_metrics)


def jumps(result: StepResult, reference: dict[str, Any], cfg: "WatchConfig") -> list[str]:
    """What increased beyond tolerance, as readable strings (empty: fine)."""
    found = []
    for key, tolerance in (("loss", cfg.loss_tolerance), ("grad_norm", cfg.grad_norm_tolerance)):
        before, now = float(reference[key]), float(getattr(result, key))
        limit = before * (1.0 + tolerance) if before > 0 else before + tolerance
        if now > limit:
            found.append(
                f"{key} {now:.4f} vs {before:.4f} {reference.get('where') or 'at step'} "
                f"{reference['step']} "
                f"(+{(now - before) / max(abs(before), 1e-12):.0%}, tolerance "
                f"{tolerance:.0%})"
            )
    return found


class PostRestoreWatchHook(TrainHook):
    def __init__(self, cfg: "WatchConfig", rank: int, run_dir: Path, ctx: "RunContext") -> None:
        self.cfg, self.rank, self.run_dir, self.ctx = cfg, rank, run_dir, ctx
        self.history: dict[int, dict[str, Any]] = {}
        self.restored = -1
        self.until = -1
        self.findings: list[str] = []
        self.checked = 0

    def on_start(self, trainer: "TrainerView") -> None:
        restored = self.ctx.restored_step
        if restored is None:
            return
        # Read before this attempt logs anything: every record here predates the failure.
        self.history = read_history(self.run_dir)
        if self.history:
            self.restored, self.until = restored, restored + self.cfg.steps

    def after_step(self, trainer: "TrainerView", result: StepResult) -> None:
        if result.step > self.until or result.skipped:  # train.guard dropped that update
            return
        reference = self.history.get(result.step) or self._recent_peak()
        self.checked += 1
        found = jumps(result, reference, self.cfg)
        if found and self.rank == 0:
            log.error(
                "POST-RESTORE WATCH: step %d after restoring step %d: %s",
                result.step,
                self.restored,
                "; ".join(found),
            )
        self.findings.extend(found)
        if found and self.cfg.stop_on_jump:
            raise RestoreDivergedError("post-restore watch: " + "; ".join(found))
        if result.step == self.until:
            self._finish()

    def _recent_peak(self) -> dict[str, Any]:
        """The last RECENT records before the failure, as one: the highest of each value."""
        steps = sorted(self.history)[-RECENT:]
        records = [self.history[s] for s in steps]
        peak = {key: max(float(r[key]) for r in records) for key in ("loss", "grad_norm")}
        return {**peak, "step": f"{steps[0]}-{steps[-1]}", "where": "the peak of steps"}

    def on_anomaly(self, trainer: "TrainerView", result: StepResult, action: str) -> None:
        # After a rollback (train.guard) the run leaves the logged trajectory on purpose.
        if action == "rollback" and self.until >= 0:
            if self.checked:
                self._finish()
            self.until = -1

    def on_end(self, trainer: "TrainerView") -> None:
        if self.checked and trainer.state.step < self.until:
            self._finish()

    def _finish(self) -> None:
        if self.rank != 0:
            return
        verdict = {
            "steps_checked": self.checked,
            "ok": not self.findings,
            "findings": self.findings[:20],
        }
        if not self.findings:
            log.info(
                "post-restore watch: %d steps match the pre-failure loss and grad norm",
                self.checked,
            )
        self.ctx.update(post_restore_watch=verdict)
