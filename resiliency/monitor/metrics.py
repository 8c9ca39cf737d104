"""Prometheus metrics from rank 0: ``<run_dir>/metrics/metrics.prom`` and an optional endpoint.

The file is replaced atomically (node-exporter textfile collector format) every
``write_interval_steps`` steps, after each save and at exit; ``http_port`` > 0 also serves the
same registry. Every series carries ``run_id``. ``resiliency/monitor/alerts/checkpoint.rules.yaml``
alerts when the newest committed checkpoint is older than twice the planned interval
(``save_interval`` x mean step time), whether or not a save reported an error.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    start_http_server,
    write_to_textfile,
)

from pretrain.train.hooks import StepResult, TrainHook
from resiliency.monitor.goodput import build_ledger
from resiliency.monitor.postmortem import read_record
from resiliency.storage.attempts import recorded_attempts

if TYPE_CHECKING:
    from pretrain.train.view import TrainerView
    from recipes.config.resiliency import MetricsConfig
    from resiliency.checkpoint.hook import CheckpointHook
    from resiliency.monitor.evidence import AttemptEvidenceHook
    from resiliency.monitor.straggler import StragglerHook
    from resiliency.run_context import RunContext

log = logging.getLogger(__name__)
METRICS_FILE = "metrics.prom"
DURATION_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800)


class RunMetrics:
    """The registry and its series for one run (labels: run_id, plus rank for stragglers)."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.registry = CollectorRegistry()
        reg, run = self.registry, ["run_id"]
        self.last_success = Gauge(
            "checkpoint_last_success_timestamp_seconds",
            "Unix time of the newest committed checkpoint",
            run,
            registry=reg,
        )
        self.planned_interval = Gauge(
            "checkpoint_planned_interval_seconds",
            "checkpoint.save_interval x mean step time",
            run,
            registry=reg,
        )
        self.last_step = Gauge(
            "checkpoint_last_step", "Step of the newest committed checkpoint", run, registry=reg
        )
        self.save_duration = Histogram(
            "checkpoint_save_duration_seconds",
            "Persistent save: start to commit",
            run,
            buckets=DURATION_BUCKETS,
            registry=reg,
        )
        self.load_duration = Histogram(
            "checkpoint_load_duration_seconds",
            "Restore: start to the first step",
            run,
            buckets=DURATION_BUCKETS,
            registry=reg,
        )
        self.queue_depth = Gauge(
            "checkpoint_async_queue_depth",
            "Async saves scheduled but not yet committed",
            run,
            registry=reg,
        )
        self.restarts = Counter(
            "training_restarts", "Earlier attempts of this run", run, registry=reg
        )
        self.lost_steps = Counter(
            "training_lost_steps", "Steps redone after failures", run, registry=reg
        )
        self.lost_tokens = Counter(
            "training_lost_tokens", "Tokens redone after failures", run, registry=reg
        )
        self.step = Gauge("training_step", "Last completed step", run, registry=reg)
        self.step_time = Gauge(
            "training_step_duration_seconds", "Mean step time this attempt", run, registry=reg
        )
        self.goodput = Gauge(
            "training_goodput_ratio",
            "Productive step time / wall time since the first launch",
            run,
            registry=reg,
        )
        self.goodput_seconds = Gauge(
            "training_goodput_seconds",
            "Wall time since the first launch by category (they add up to the wall time)",
            ["run_id", "category"],
            registry=reg,
        )
        per_rank = ["run_id", "rank"]
        self.relative = Gauge(
            "straggler_relative_score",
            "Fastest rank's step time / this rank's (1 = fastest)",
            per_rank,
            registry=reg,
        )
        self.individual = Gauge(
            "straggler_individual_score",
            "This rank's best step time / its current one",
            per_rank,
            registry=reg,
        )
        self.straggler = Gauge(
            "straggler_detected", "1 if the last report named the rank", per_rank, registry=reg
        )

    def labels(self, metric: Any, **extra: Any) -> Any:
        return metric.labels(run_id=self.run_id, **{k: str(v) for k, v in extra.items()})


class MetricsHook(TrainHook):
    """Rank 0 only (the factory leaves it out elsewhere)."""

    def __init__(
        self,
        cfg: "MetricsConfig",
        run_id: str,
        ctx: "RunContext",
        checkpoint: "CheckpointHook | None",
        evidence: "AttemptEvidenceHook | None",
        straggler: "StragglerHook | None",
    ) -> None:
        """``checkpoint``: read for its save statistics only."""
        self.cfg, self.path = cfg, ctx.layout.metrics_dir / METRICS_FILE
        self.ctx, self.checkpoint = ctx, checkpoint
        self.evidence, self.straggler = evidence, straggler
        self.m = RunMetrics(run_id)
        self.step_times: list[float] = []
        self.saves_seen = 0
        self.server: Any = None
        self.history_done = False

    def on_start(self, trainer: "TrainerView") -> None:
        if self.cfg.http_port:
            self.server, _ = _serve(self.cfg.http_port, self.m.registry)
            log.info("metrics: serving on port %d", self.cfg.http_port)
        self.m.labels(self.m.last_success).set(self._last_success_fallback())
        started = self.evidence.times.get("load_started_at") if self.evidence else None
        if started is not None and self.ctx.restored_step:
            self.m.labels(self.m.load_duration).observe(time.time() - started)

    def after_step(self, trainer: "TrainerView", result: StepResult) -> None:
        if not self.history_done:
            self._count_history(trainer)  # after the evidence hook's first-step record
        self.step_times.append(result.step_time_s)
        saved = self._update(trainer, result.step)
        if saved or result.step % self.cfg.write_interval_steps == 0:
            self.write_or_warn()

    def on_end(self, trainer: "TrainerView") -> None:
        self._update(trainer, trainer.state.step)
        self._update_goodput(trainer)
        self.write_or_warn()

    def _update_goodput(self, trainer: "TrainerView") -> None:
        """The ledger across every attempt so far (read from the run's own files; the
        current attempt's end is not recorded yet, so it counts up to its last step), as
        gauges and as the run's goodput/* scalars (TensorBoard, W&B)."""
        ledger = build_ledger(self.path.parent.parent)
        if ledger.goodput is None:
            return
        self.m.labels(self.m.goodput).set(ledger.goodput)
        for category, seconds in ledger.seconds.items():
            self.m.labels(self.m.goodput_seconds, category=category).set(seconds)
        scalars = {f"goodput/{c}_s": v for c, v in ledger.seconds.items()}
        trainer.report({"goodput/ratio": ledger.goodput, **scalars}, trainer.state.step)

    def on_exception(self, trainer: "TrainerView | None", exc: BaseException) -> None:
        if trainer is None:
            return  # failed before owning the run (e.g. lease held): the file is not ours
        self.write_or_warn()

    def write_or_warn(self) -> None:
        """Metrics are not worth a training failure: a full disk (say, while an async save
        writes) must surface as that save's failure, which cleans up after itself."""
        try:
            self.write()
        except OSError as err:
            log.warning("metrics: could not write %s: %s", self.path, err)

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server = None

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_to_textfile(str(self.path), self.m.registry)

    # -- sources
    def _checkpointer(self) -> Any:
        return self.checkpoint.checkpointer if self.checkpoint is not None else None

    def _last_success_fallback(self) -> float:
        # Before this attempt's first save, the newest committed one is the restored step (its
        # dir's mtime) or, on a fresh run, none: count the age from the attempt's start.
        if self.ctx.restored_step is not None:
            step_dir = self.ctx.layout.step_dir(self.ctx.restored_step)
            if step_dir.exists():
                return step_dir.stat().st_mtime
        return self.ctx.info.get("start_time", time.time())

    def _update(self, trainer: "TrainerView", step: int) -> bool:
        m = self.m
        m.labels(m.step).set(step)
        mean = sum(self.step_times) / len(self.step_times) if self.step_times else 0.0
        m.labels(m.step_time).set(mean)
        interval = trainer.run.checkpoint.save_interval
        if interval and mean:
            m.labels(m.planned_interval).set(interval * mean)
        self._update_straggler()
        return self._update_checkpoint()

    def _update_checkpoint(self) -> bool:
        checkpointer, m = self._checkpointer(), self.m
        if checkpointer is None:
            return False
        stats = checkpointer.stats
        new = stats.durations_s[self.saves_seen :]
        for duration in new:
            m.labels(m.save_duration).observe(duration)
        self.saves_seen = len(stats.durations_s)
        if stats.last_success_time is not None:
            m.labels(m.last_success).set(stats.last_success_time)
        last = stats.last_step if stats.last_step is not None else checkpointer.restored_step
        if last is not None:
            m.labels(m.last_step).set(last)
        queue = checkpointer.queue
        depth = queue.get_num_unfinalized_calls() if queue is not None else 0
        m.labels(m.queue_depth).set(depth)
        return bool(new)

    def _update_straggler(self) -> None:
        report = self.straggler.last if self.straggler is not None else None
        if report is None:
            return
        for rank, score in report.relative.items():
            self.m.labels(self.m.relative, rank=rank).set(score)
            self.m.labels(self.m.straggler, rank=rank).set(int(rank in report.stragglers))
        for rank, score in report.individual.items():
            self.m.labels(self.m.individual, rank=rank).set(score)

    def _count_history(self, trainer: "TrainerView") -> None:
        """Restarts and losses of the earlier attempts of this run (records + this recovery)."""
        self.history_done = True
        layout, attempt = self.ctx.layout, self.ctx.attempt
        earlier = [a for a in recorded_attempts(layout) if a < attempt]
        recovered = self.ctx.info.get("recovered_from") or {}
        steps = tokens = 0
        for previous in earlier:
            record = read_record(layout, previous)
            if previous == recovered.get("attempt") and "lost_steps" not in record:
                record = recovered
            steps += int(record.get("lost_steps") or 0)
            tokens += int(record.get("lost_tokens") or 0)
        self.m.labels(self.m.restarts).inc(len(earlier))
        self.m.labels(self.m.lost_steps).inc(steps)
        self.m.labels(self.m.lost_tokens).inc(tokens)


def _serve(port: int, registry: CollectorRegistry) -> tuple[Any, Any]:
    return start_http_server(port, registry=registry)
