"""Prometheus metrics: the rank-0 file parses and carries the checkpoint, restart and straggler
values; the endpoint serves the same registry; the shipped alert rule is the reference one."""

from __future__ import annotations

import json
import socket
import urllib.request
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from resiliency.monitor.metrics import METRICS_FILE, RunMetrics, _serve
from tests.ft_helpers import SAVE_EVERY, STEPS, attempt, clean_run

RULES = (
    Path(__file__).resolve().parents[2]
    / "resiliency"
    / "monitor"
    / "alerts"
    / "checkpoint.rules.yaml"
)


def parse(text: str) -> dict[str, list]:
    """family name -> samples (the family name drops _total/_bucket... suffixes)."""
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def value(
    families: dict[str, list], family: str, sample: str | None = None, **labels: str
) -> float:
    matches = [
        s.value
        for s in families[family]
        if s.name == (sample or family) and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    assert len(matches) == 1, (family, sample, labels, families.get(family))
    return matches[0]


def test_alert_rule_is_the_reference_expression() -> None:
    rules = yaml.safe_load(RULES.read_text())["groups"][0]["rules"]
    overdue = next(r for r in rules if r["alert"] == "CheckpointOverdue")
    assert " ".join(overdue["expr"].split()) == (
        "time() - max by (run_id) (checkpoint_last_success_timestamp_seconds) "
        "> 2 * max by (run_id) (checkpoint_planned_interval_seconds)"
    )


def test_remote_lag_rule_is_the_reference_expression() -> None:
    rules = yaml.safe_load(RULES.read_text())["groups"][0]["rules"]
    lagging = next(r for r in rules if r["alert"] == "CheckpointRemoteLagging")
    assert " ".join(lagging["expr"].split()) == (
        "max by (run_id) (checkpoint_remote_lag_steps) "
        "> 2 * max by (run_id) (checkpoint_remote_save_interval_steps)"
    )


def test_http_endpoint_serves_the_registry() -> None:
    metrics = RunMetrics("web")
    metrics.labels(metrics.last_success).set(123.0)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server, _ = _serve(port, metrics.registry)
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    finally:
        server.shutdown()
    families = parse(text.decode())
    assert value(families, "checkpoint_last_success_timestamp_seconds", run_id="web") == 123.0


@pytest.mark.slow
def test_metrics_file_of_a_clean_run(
    tiny_overrides: list[str], tmp_path_factory: pytest.TempPathFactory
) -> None:
    run_dir = clean_run(tiny_overrides, tmp_path_factory.getbasetemp())
    families = parse((run_dir / "metrics" / METRICS_FILE).read_text())
    record = attempt(run_dir, 1)
    run = {"run_id": "clean"}

    last_success = value(families, "checkpoint_last_success_timestamp_seconds", **run)
    assert record["start_time"] < last_success <= record["end_time"]
    step_time = value(families, "training_step_duration_seconds", **run)
    assert value(families, "checkpoint_planned_interval_seconds", **run) == pytest.approx(
        SAVE_EVERY * step_time
    )
    assert value(families, "checkpoint_last_step", **run) == STEPS
    saves = value(
        families,
        "checkpoint_save_duration_seconds",
        "checkpoint_save_duration_seconds_count",
        **run,
    )
    assert saves == STEPS // SAVE_EVERY
    assert value(families, "checkpoint_async_queue_depth", **run) == 0
    assert value(families, "training_restarts", "training_restarts_total", **run) == 0
    assert value(families, "training_lost_steps", "training_lost_steps_total", **run) == 0
    assert value(families, "training_step", **run) == STEPS
    for rank in ("0", "1"):
        assert 0 < value(families, "straggler_relative_score", rank=rank, **run) <= 1
        assert value(families, "straggler_detected", rank=rank, **run) == 0
    labelled = [s for samples in families.values() for s in samples]
    assert labelled and all(s.labels.get("run_id") == "clean" for s in labelled)
    reports = (run_dir / "metrics" / "straggler.jsonl").read_text().splitlines()
    assert json.loads(reports[-1])["relative"] == {
        r: value(families, "straggler_relative_score", rank=r, **run) for r in ("0", "1")
    }
