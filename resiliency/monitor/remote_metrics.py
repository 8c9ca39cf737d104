"""The uploader's own Prometheus textfile, ``<run_dir>/metrics/remote.prom``, beside rank 0's
``metrics.prom``: the uploader is its own process and outlives the trainer, so it reports for
itself. ``alerts/checkpoint.rules.yaml`` (CheckpointRemoteLagging) fires when the remote tier is
more than two save intervals behind the newest local step."""

from __future__ import annotations

import logging
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, write_to_textfile

from resiliency.storage.layout import RunLayout
from resiliency.storage.remote import UploadPass

log = logging.getLogger(__name__)
REMOTE_METRICS_FILE = "remote.prom"


class RemoteUploadMetrics:
    """One uploader's series (label run_id), written after every pass."""

    def __init__(self, layout: RunLayout, save_interval: int | None) -> None:
        self.layout, self.registry = layout, CollectorRegistry()
        reg, run = self.registry, ["run_id"]
        self.committed = Gauge(
            "checkpoint_remote_last_committed_step",
            "Newest step committed on the object store",
            run,
            registry=reg,
        )
        self.lag = Gauge("checkpoint_remote_lag_steps",
                         "Newest local published step minus the newest remote committed one",
                         run, registry=reg)  # fmt: skip
        self.errors = Counter(
            "checkpoint_remote_upload_errors_total",
            "Steps skipped and passes failed by the uploader",
            run,
            registry=reg,
        )
        self.sent = Counter("checkpoint_remote_uploaded_bytes_total",
                            "Bytes the uploader sent", run, registry=reg)  # fmt: skip
        self.rate = Gauge(
            "checkpoint_remote_upload_bytes_per_second",
            "Throughput of the last step uploaded",
            run,
            registry=reg,
        )
        self.interval = Gauge("checkpoint_remote_save_interval_steps",
                              "The run's checkpoint.save_interval (the lag alert's unit)",
                              run, registry=reg)  # fmt: skip
        self.last_pass = Gauge(
            "checkpoint_remote_last_pass_timestamp_seconds",
            "Unix time the uploader last finished a pass",
            run,
            registry=reg,
        )
        if save_interval:
            self.interval.labels(layout.run_id).set(save_interval)

    def record(self, result: UploadPass | None, errors: int = 0) -> None:
        """After a pass (``result`` None: it failed as a whole); ``errors`` more to count."""
        run = self.layout.run_id
        if errors:
            self.errors.labels(run).inc(errors)
        if result is not None:
            self.errors.labels(run).inc(len(result.skipped))
            newest = result.committed[-1] if result.committed else None
            if newest is not None:
                self.committed.labels(run).set(newest)
            if result.newest_local is not None:
                self.lag.labels(run).set(result.newest_local - (newest or 0))
            for report in result.reports:
                self.sent.labels(run).inc(report.bytes_sent)
                if report.seconds > 0:
                    self.rate.labels(run).set(report.bytes_sent / report.seconds)
            self.last_pass.labels(run).set(time.time())
        self.write()

    def write(self) -> None:
        try:
            self.layout.metrics_dir.mkdir(parents=True, exist_ok=True)
            write_to_textfile(str(self.layout.metrics_dir / REMOTE_METRICS_FILE), self.registry)
        except OSError as exc:  # metrics never stop uploads
            log.warning("remote metrics not written: %s", exc)
