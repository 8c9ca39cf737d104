"""Node health checks, the requeue ledger and node exclusion (units; the real-cluster test of
exclusion and shrinking is in tests/integration/test_slurm.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launch.requeues import append_ledger, excluded_so_far, failures_used, plan_exclusion
from launch.retry_policy import FAILURE, PLANNED, REQUEUE, decide
from recipes import ConfigError, load_config, to_yaml
from resiliency.monitor.health import check_node, read_reports, unhealthy_nodes
from tests.helpers import REPO


def _run(tmp_path: Path, *overrides: str):  # noqa: ANN202 - a RunConfig
    return load_config(["recipe=gpt_tiny", f"output_dir={tmp_path}", *overrides])


def test_healthy_node_passes_every_check(tmp_path: Path) -> None:
    report = check_node(_run(tmp_path), cpus_expected=1)
    assert report.ok, report.failures()
    names = [c.name for c in report.checks]
    assert names == ["checkpoint_dir", "shm", "gpus", "cpus"]
    cpus = next(c for c in report.checks if c.name == "cpus")
    assert cpus.detail.startswith(f"{len(os.sched_getaffinity(0))} usable")


@pytest.mark.parametrize(
    "override, failing",
    [
        ("resiliency.health.min_free_gib=1e9", "checkpoint_dir"),
        ("resiliency.health.min_shm_gib=1e9", "shm"),
        (
            "resiliency.health.script='sh -c \"echo bad DIMM on $MCORE_RECIPES_NODE; exit 3\"'",
            "script",
        ),
        ("launch.gpus_per_node=2", "gpus"),  # no nvidia-smi here
    ],
)
def test_each_check_can_fail(tmp_path: Path, override: str, failing: str) -> None:
    extra = ["launch.nproc_per_node=2"] if "gpus" in override else []
    report = check_node(_run(tmp_path, override, *extra))
    assert not report.ok
    assert [c.name for c in report.checks if not c.ok] == [failing], report.failures()
    if failing == "script":
        assert f"bad DIMM on {report.node}" in report.failures()[0]


def test_too_few_cpus_fails(tmp_path: Path) -> None:
    report = check_node(_run(tmp_path), cpus_expected=len(os.sched_getaffinity(0)) + 1)
    assert [c.name for c in report.checks if not c.ok] == ["cpus"]


def test_cli_writes_the_report_and_exits_1_when_unhealthy(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(to_yaml(_run(tmp_path, "run_id=h", "resiliency.health.script=/bin/false")))
    out = tmp_path / "health"
    env = {**os.environ, "SLURMD_NODENAME": "node7"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "resiliency.monitor.health",
            "--config",
            str(config),
            "--out",
            str(out),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1, proc
    assert proc.stdout.startswith("node node7: UNHEALTHY: script: '/bin/false' exit 1"), proc.stdout
    [report] = read_reports(out)
    assert (report["node"], report["ok"]) == ("node7", False)
    assert unhealthy_nodes(out) == ["node7"]
    assert json.loads((out / "node7.json").read_text())["checks"][-1]["name"] == "script"


def test_bad_health_config_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="min_free_gib must be >= 0"):
        _run(tmp_path, "resiliency.health.min_free_gib=-1")


# ------------------------------------------------------------------ exclusion


def test_exclusion_leaves_failed_nodes_out() -> None:
    ex = plan_exclusion(
        ["n3"], [], launch_nodes=2, min_nodes=None, partition_nodes=4, max_excluded=2
    )
    assert (ex.exclude, ex.nodes) == (("n3",), 2)
    assert ex.scontrol_updates(2, 8, []) == "ExcNodeList=n3"


def test_exclusion_never_leaves_too_few_nodes() -> None:
    ex = plan_exclusion(
        ["n2"], [], launch_nodes=2, min_nodes=None, partition_nodes=2, max_excluded=2
    )
    assert (ex.exclude, ex.nodes) == ((), 2)
    assert "not excluding n2" in ex.note and "min_nodes" in ex.note
    assert ex.scontrol_updates(2, 1, []) == ""


def test_exclusion_shrinks_down_to_min_nodes() -> None:
    ex = plan_exclusion(["n2"], [], launch_nodes=2, min_nodes=1, partition_nodes=2, max_excluded=2)
    assert (ex.exclude, ex.nodes) == (("n2",), 1)
    # CPUs and tasks first (Slurm keeps the node count its CPU count implies), then nodes
    assert ex.scontrol_updates(2, 4, []) == "ExcNodeList=n2 NumCPUs=4 NumTasks=1;NumNodes=1"
    again = plan_exclusion(
        ["n1"], ["n2"], launch_nodes=2, min_nodes=1, partition_nodes=2, max_excluded=2
    )
    assert again.exclude == ("n2",) and "not excluding n1" in again.note  # never zero nodes


def test_exclusion_cap() -> None:
    ex = plan_exclusion(
        ["a", "b", "c"], [], launch_nodes=1, min_nodes=None, partition_nodes=10, max_excluded=2
    )
    assert ex.exclude == ("a", "b") and "max_excluded_nodes=2" in ex.note


def test_ledger_counts_failures_not_planned_requeues(tmp_path: Path) -> None:
    for kind in (PLANNED, FAILURE, PLANNED, PLANNED):
        append_ledger(tmp_path, {"job_id": "7", "kind": kind, "exclude": []})
    append_ledger(tmp_path, {"job_id": "8", "kind": FAILURE, "exclude": ["n2"]})
    assert failures_used(tmp_path, "7") == 1 and failures_used(tmp_path, "8") == 1
    assert excluded_so_far(tmp_path, "8") == ["n2"] and excluded_so_far(tmp_path, "9") == []


def test_unhealthy_node_is_a_budgeted_requeue(tmp_path: Path) -> None:
    decision = decide(tmp_path, failures_used=0, max_requeues=1, unhealthy=("node2",))
    assert (decision.action, decision.kind) == (REQUEUE, FAILURE)
    assert "node2 failed the health check" in decision.reason
    decision = decide(tmp_path, failures_used=1, max_requeues=1, unhealthy=("node2",))
    assert decision.action == "stop" and "budget exhausted" in decision.reason


def test_local_launch_on_an_unhealthy_machine_stops_before_any_rank(
    stdlib_corpus: str, tmp_path: Path
) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "launch",
            "local",
            "recipe=gpt_tiny",
            f"data.paths=[{stdlib_corpus}]",
            f"output_dir={tmp_path}",
            "run_id=sick",
            "resiliency.health.min_shm_gib=1e9",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr[-2000:]  # infrastructure: retry on another node
    assert "UNHEALTHY: shm: /dev/shm is" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "sick" / "attempts").exists()  # no rank started
    [report] = read_reports(next((tmp_path / "sick" / "health").iterdir()))
    assert report["ok"] is False
