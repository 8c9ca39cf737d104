"""Straggler detection: a rank slowed 3x is named within two report intervals; a clean run of
the same length names nobody."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pretrain.context import exit_codes
from pretrain.platform.cpu_shim import nvrx_straggler_on_cpu
from recipes.config.resiliency import StragglerConfig
from resiliency.monitor.straggler import REPORTS_FILE, summarize
from resiliency.storage.layout import RunLayout
from tests.ft_helpers import STRAGGLER, attempts, base_overrides, clean_run, launch_local

SLOW_STEP, INTERVAL = 5, 4


def reports(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics" / REPORTS_FILE
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_summary_names_only_ranks_slower_than_their_peers() -> None:
    nan = float("nan")
    report = SimpleNamespace(
        section_relative_perf_scores={"step": {0: 1.0, 1: 0.4, 2: 0.95}},
        section_individual_perf_scores={"step": {0: 0.5, 1: 0.35, 2: 1.0}},
        gpu_relative_perf_scores={0: nan, 1: nan, 2: nan},
    )
    summary = summarize(report, 8, StragglerConfig())
    assert summary.stragglers == [1]
    assert summary.relative[1] == 0.4 and summary.individual[1] == 0.35
    # Rank 0 is slower than its own best but as fast as its peers: the machine, not the rank.
    assert summary.slower_than_before == [0]
    assert summary.gpu_relative == {}  # no CUDA kernel scores on CPU


@pytest.mark.current_stack
def test_cpu_sections_time_work_not_waiting(monkeypatch: pytest.MonkeyPatch) -> None:
    nvrx_straggler_on_cpu("cpu")  # CUPTI stub + CPU-time section clock
    from pretrain.platform.compat import nvrx_straggler

    straggler = nvrx_straggler()
    Statistic = nvrx_straggler("statistics").Statistic

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    straggler.Detector.initialize(report_time_interval=1e9)
    try:
        for _ in range(3):
            with straggler.Detector.detection_section("wait", profile_cuda=False):
                time.sleep(0.1)  # a rank blocked in a collective: no CPU time
            with straggler.Detector.detection_section("work", profile_cuda=False):
                deadline = time.process_time() + 0.1
                while time.process_time() < deadline:
                    pass
        summaries = straggler.Detector.generate_report().local_section_summaries
    finally:
        straggler.Detector.shutdown()
    # Section statistics are in milliseconds.
    assert summaries["wait"][Statistic.MED] < 20 < 90 < summaries["work"][Statistic.MED]


@pytest.mark.slow
@pytest.mark.current_stack
def test_slow_rank_is_named_within_two_intervals(tiny_overrides: list[str], tmp_path: Path) -> None:
    # The torchrun backend: straggler detection does not need ft_launcher.
    overrides = [
        *base_overrides(tiny_overrides, tmp_path, "slow"),
        "launch.backend=torchrun",
        f"train.fault=slow@{SLOW_STEP}:1:3",
        "resiliency.straggler.stop_if_detected=true",
    ]
    assert f"resiliency.straggler.report_interval={INTERVAL}" in STRAGGLER
    proc = launch_local(overrides)
    assert proc.returncode == exit_codes.STRAGGLER, proc.stderr[-6000:]
    (record,) = attempts(tmp_path / "slow")  # stopped on purpose: not retried
    found = reports(tmp_path / "slow")
    named = [r for r in found if 1 in r["stragglers"]]
    assert named and named[0]["step"] <= SLOW_STEP + 2 * INTERVAL
    assert all(0 not in r["stragglers"] for r in found)
    first = named[0]
    assert first["relative"]["1"] < 0.6 and first["relative"]["0"] == 1.0
    assert "1" in first["individual"]
    assert "straggler report at step" in proc.stderr and "slow rank(s) [1]" in proc.stderr
    # Graceful stop at the first report that named it: saved, recorded, exit STRAGGLER.
    assert found[-1] == first and record["step"] == first["step"]
    assert record["exit_code"] == exit_codes.STRAGGLER
    assert first["step"] in RunLayout.from_run_dir(tmp_path / "slow").published_steps()


@pytest.mark.slow
def test_clean_run_names_no_straggler(
    tiny_overrides: list[str], tmp_path_factory: pytest.TempPathFactory
) -> None:
    found = reports(clean_run(tiny_overrides, tmp_path_factory.getbasetemp()))
    assert [r["step"] for r in found] == [4, 8, 12]
    assert all(r["stragglers"] == [] for r in found), found
