"""``python -m drill``: the fault experiment passes on CPU and catches inexact resume.

The slow tests run real training jobs (torchrun, 2 ranks, gpt_tiny): one full drill (about
3 minutes on 2 cores) and one recovery-only drill whose resumed launches run without the
megatron-core compat fix I, which makes resumed losses drift.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from drill.acceptance import FAIL, PASS
from drill.cli import main
from drill.experiment import DrillConfig, DrillResult, prepare_out, run_drill
from drill.jobs import DrillError, LaunchResult, LaunchSpec
from drill.runs import DrillPlan, Runner, Scenario
from pretrain.context import exit_codes
from pretrain.platform.compat import SKIP_ENV
from resiliency.storage.attempts import write_attempt_record
from resiliency.storage.layout import RunLayout

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def drill(tmp_path_factory: pytest.TempPathFactory, tiny_overrides: list[str]) -> DrillResult:
    out = tmp_path_factory.mktemp("drill")
    return run_drill(DrillConfig(out=out, overrides=tuple(tiny_overrides)))


@pytest.mark.slow
def test_drill_passes_every_item(drill: DrillResult) -> None:
    report = drill.report.read_text()
    problems = {c.id: c.problems for c in drill.checks if c.status != PASS}
    assert not problems, f"{problems}\n{report}"
    assert drill.exit_code == 0
    assert report.startswith("# Fault-recovery drill: PASS")
    for check in drill.checks:
        assert f"`{check.id}`" in report
    for row in ("checkpoint save", "load (attempt start", "RTO (first new step)"):
        assert row in report


@pytest.mark.slow
def test_recovered_curve_overlaps_the_baseline(drill: DrillResult) -> None:
    plot, steps = drill.plot, drill.data.plan.steps
    assert plot.baseline.steps == plot.recovered.steps == tuple(range(1, steps + 1))
    assert plot.restores == ((2, 4), (3, 8))  # (attempt, restored step)
    assert [step for step, _ in plot.failures] == [5, 9]  # last step before each kill
    first_restore = plot.restores[0][1]
    baseline = dict(zip(plot.baseline.steps, plot.baseline.values))
    after = [
        (s, v) for s, v in zip(plot.recovered.steps, plot.recovered.values) if s > first_restore
    ]
    assert after and all(v == baseline[s] for s, v in after)
    # the resumed attempts' own curves (redone steps included) lie on the baseline too
    for curve in plot.attempts[1:]:
        assert curve.steps[0] > first_restore
        assert list(curve.values) == [baseline[s] for s in curve.steps]
    png = drill.report.parent / "loss.png"
    assert png.read_bytes()[:8] == PNG_SIGNATURE
    from PIL import Image

    with Image.open(png) as image:
        image.verify()
        assert image.size[0] > 500 and image.size[1] > 400


@pytest.mark.slow
def test_drill_records_lost_steps_and_timings(drill: DrillResult) -> None:
    saved = json.loads((drill.report.parent / "drill.json").read_text())
    timings = saved["timings"]
    assert [(t["last_step"], t["restored_step"], t["lost_steps"]) for t in timings] == [
        (5, 4, 1),
        (9, 8, 1),
    ]
    assert all(t["rto_s"] > 0 and t["load_s"] > 0 for t in timings)
    budget = drill.data.scenarios["budget"]
    assert [d.exit_code for d in budget.decisions] == [0, 0, exit_codes.RETRY_BUDGET_EXHAUSTED]


@pytest.mark.slow
def test_inexact_resume_fails_the_drill(
    tiny_overrides: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Resumed launches without compat fix I drift from the baseline: the drill must say so."""
    code = main(
        [
            "--out",
            str(tmp_path / "drill"),
            "--scenarios",
            "recovery",
            "--resume-env",
            f"{SKIP_ENV}=I",
            *tiny_overrides,
        ]
    )
    out = capsys.readouterr().out
    assert code == 1, out
    assert "drill FAILED: " in out and "exact_resume" in out.split("drill FAILED: ")[1], out
    checks = json.loads((tmp_path / "drill" / "drill.json").read_text())["checks"]
    exact = next(c for c in checks if c["id"] == "exact_resume")
    assert exact["status"] == FAIL
    assert any("loss" in p and "!= baseline" in p for p in exact["problems"]), exact
    # the broken and budget scenarios were not asked for: skipped, not failed
    statuses = {c["id"]: c["status"] for c in checks}
    assert statuses["retry_budget"] == statuses["fallback_no_commit"] == "skip"
    report = (tmp_path / "drill" / "report.md").read_text()
    assert report.startswith("# Fault-recovery drill: FAIL (") and "exact_resume" in report


# ---------------------------------------------------------------- fast: no training


def test_slurm_launcher_without_sbatch_is_a_clear_error(
    tiny_overrides: list[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    out = tmp_path / "drill"
    assert main(["--launcher", "slurm", "--out", str(out), *tiny_overrides]) == 2
    message = capsys.readouterr().out
    assert "sbatch" in message and "not found on PATH" in message and "--launcher local" in message
    assert not out.exists()


@pytest.mark.parametrize(
    "plan, message",
    [
        (DrillPlan(kills=(3, 10)), "start after the first save"),
        (DrillPlan(kills=(6, 7)), "put a save between consecutive kills"),
        (DrillPlan(kills=(6, 20)), "end by step 16"),
        (DrillPlan(kills=(6, 10), max_retries=1), "at least as many retries"),
        (DrillPlan(steps=4, save_every=4), "save_every < steps"),
    ],
)
def test_bad_plans_are_refused(plan: DrillPlan, message: str) -> None:
    with pytest.raises(DrillError, match=message):
        plan.validate()


def test_default_kills_fall_between_saves() -> None:
    assert DrillPlan.default_kills(4) == (6, 10) == DrillPlan().kills
    DrillPlan(kills=DrillPlan.default_kills(1), save_every=1).validate()


def test_output_dir_must_be_new_or_an_earlier_drill(tmp_path: Path) -> None:
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "precious.txt").write_text("keep me")
    with pytest.raises(DrillError, match="not empty"):
        prepare_out(foreign)
    assert (foreign / "precious.txt").exists()
    earlier = prepare_out(tmp_path / "earlier")
    (earlier / "report.md").write_text("old")
    (earlier / "runs").mkdir()
    assert prepare_out(earlier) == earlier
    assert sorted(p.name for p in earlier.iterdir()) == [".mcore-recipes-drill"]


class FailingLauncher:
    """Each launch records one failed attempt, as a rank killed by the infrastructure would."""

    nproc = 2

    def launch(self, spec: LaunchSpec) -> LaunchResult:
        layout = RunLayout.from_run_dir(spec.run_dir)
        attempt = len(list(layout.attempts_dir.glob("attempt-*.json"))) + 1
        write_attempt_record(
            layout, attempt, {"status": "failed", "exit_code": 1, "failure_class": "infrastructure"}
        )
        return LaunchResult(spec, 1, 0.0, 1.0, ())


def test_relaunch_loop_stops_when_the_budget_is_spent(tmp_path: Path) -> None:
    runner = Runner(
        FailingLauncher(),
        ["recipe=gpt_tiny"],
        tmp_path / "runs",
        tmp_path / "logs",
        "run",
        DrillPlan(max_retries=2),
    )
    scenario = runner.budget()
    assert isinstance(scenario, Scenario) and len(scenario.launches) == 3
    assert [(d.action, d.exit_code) for d in scenario.decisions if d] == [
        ("requeue", 0),
        ("requeue", 0),
        ("stop", exit_codes.RETRY_BUDGET_EXHAUSTED),
    ]
    assert scenario.attempts == [1, 2, 3]
    assert all("train.fault=kill@2:1" in r.spec.overrides for r in scenario.launches)
