"""Prometheus metrics: the rank-0 file parses and carries the checkpoint, restart and straggler
values; the endpoint serves the same registry; the shipped alert rule is the reference one."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
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


def _rules_annotations() -> dict[str, dict[str, str]]:
    """Each alert's annotations as the rule file writes them, for run "r" and rank 3."""
    rules = yaml.safe_load(RULES.read_text())["groups"][0]["rules"]
    out = {}
    for rule in rules:
        text = {k: v.replace("{{ $labels.run_id }}", "r").replace("{{ $labels.rank }}", "3")
                for k, v in rule.get("annotations", {}).items()}  # fmt: skip
        out[rule["alert"]] = text
    return out


def _alert(name: str, at: str, firing: bool, **labels: str) -> dict:
    severity = {"CheckpointOverdue": "page", "CheckpointRemoteLagging": "page"}.get(name, "warn")
    expected = [{"exp_labels": {"severity": severity, "run_id": "r", **labels},
                 "exp_annotations": _rules_annotations()[name]}] if firing else []  # fmt: skip
    return {"eval_time": at, "alertname": name, "exp_alerts": expected}


def test_alert_rules_fire_when_their_series_cross_and_not_before(tmp_path: Path) -> None:
    """promtool (Prometheus' own rule evaluator) on series that cross each threshold, and on
    series that stay at it: pending for the rule's `for`, firing after, never on the edge."""
    promtool = shutil.which("promtool")
    if promtool is None:
        if os.environ.get("CI"):
            pytest.fail("promtool is missing: .ci/run installs Debian's prometheus package")
        pytest.skip("promtool is not installed (apt-get install prometheus)")
    tests = {
        "rule_files": [str(RULES)],
        "evaluation_interval": "1m",
        "tests": [
            {   # last success at t=0, planned every 5 min: over 2 x 300 s from 11m, firing 16m
                "interval": "1m",
                "input_series": [
                    {"series": 'checkpoint_last_success_timestamp_seconds{run_id="r"}',
                     "values": "0+0x30"},
                    {"series": 'checkpoint_planned_interval_seconds{run_id="r"}',
                     "values": "300+0x30"},
                    # a queue that drains (r) stays quiet; one stuck at 1 from 3m fires at 18m
                    {"series": 'checkpoint_async_queue_depth{run_id="r"}',
                     "values": "0 0 0 1+0x30"},
                    {"series": 'checkpoint_async_queue_depth{run_id="ok"}',
                     "values": "1 0 1 0 1 0 1 0 1 0 1 0 1 0 1 0 1 0 1 0 1 0"},
                    # 5 steps behind a 2-step interval: over 2 x 2 from 0, firing at 10m; a run
                    # exactly 4 behind (ok) is not over
                    {"series": 'checkpoint_remote_lag_steps{run_id="r"}', "values": "5+0x30"},
                    {"series": 'checkpoint_remote_save_interval_steps{run_id="r"}',
                     "values": "2+0x30"},
                    {"series": 'checkpoint_remote_lag_steps{run_id="ok"}', "values": "4+0x30"},
                    {"series": 'checkpoint_remote_save_interval_steps{run_id="ok"}',
                     "values": "2+0x30"},
                    {"series": 'straggler_detected{run_id="r",rank="3"}', "values": "1+0x30"},
                    {"series": 'straggler_detected{run_id="r",rank="1"}', "values": "0+0x30"},
                ],
                "alert_rule_test": [
                    _alert("CheckpointOverdue", "10m", False),
                    _alert("CheckpointOverdue", "15m", False),  # pending since 11m
                    _alert("CheckpointOverdue", "16m", True),
                    _alert("CheckpointAsyncQueueBacklog", "17m", False),
                    _alert("CheckpointAsyncQueueBacklog", "18m", True),
                    _alert("CheckpointRemoteLagging", "9m", False),
                    _alert("CheckpointRemoteLagging", "10m", True),
                    _alert("TrainingStraggler", "9m", False),
                    _alert("TrainingStraggler", "10m", True, rank="3"),
                ],
            }
        ],
    }  # fmt: skip
    spec = tmp_path / "rules_test.yaml"
    spec.write_text(yaml.safe_dump(tests, sort_keys=False))
    proc = subprocess.run([promtool, "test", "rules", str(spec)], capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout + proc.stderr


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
