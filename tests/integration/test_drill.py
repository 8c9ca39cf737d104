"""``python -m drill``: the fault experiment passes on CPU and catches inexact resume.

The slow tests share one full drill of real training jobs (torchrun, 2 ranks, gpt_tiny; about
a minute and a half on 2 cores); one of them judges its recovery run again with a loss moved by
one ulp in the trainer's own step file, which the drill must catch.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shutil
from pathlib import Path

import pytest

from drill.acceptance import FAIL, PASS, run_checks
from drill.cli import main
from drill.experiment import (
    DrillConfig,
    DrillResult,
    add_args,
    config_from_args,
    prepare_out,
    run_drill,
    verdict_line,
)
from drill.jobs import DrillError, LaunchResult, LaunchSpec
from drill.report import plot_data, write_report
from drill.run_records import read_run, restore_events
from drill.runs import BASELINE, RECOVERY, DrillPlan, ResumeExtras, Runner, Scenario
from pretrain.context import exit_codes
from pretrain.context.run_dir import RunDir
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
def test_a_resume_that_drifts_by_one_ulp_fails_the_drill(
    drill: DrillResult, tmp_path: Path
) -> None:
    """The drill's own recovery run with one loss after the first restore moved by one ulp in
    the file the trainer wrote: judged again, the drill fails ``exact_resume`` and names the
    step. (That a resume without compat fix I really drifts is test_compat's; this one costs no
    second drill.) Only the recovery scenario asked for: the others are skipped, not failed."""
    recovery = drill.data.scenarios[RECOVERY]
    forged_dir = tmp_path / "forged" / recovery.run_dir.name  # its name is its run id
    shutil.copytree(recovery.run_dir, forged_dir)
    steps_file = RunDir(forged_dir).steps_metrics
    rows = [json.loads(line) for line in steps_file.read_text().splitlines()]
    drifted = drill.plot.restores[0][1] + 1  # the first step the resumed attempt trained
    redone = max(i for i, row in enumerate(rows) if row["step"] == drifted)
    rows[redone]["loss"] = math.nextafter(rows[redone]["loss"], math.inf)
    steps_file.write_text("".join(json.dumps(row) + "\n" for row in rows))
    forged = dataclasses.replace(recovery, run_dir=forged_dir)
    run = read_run(forged_dir)
    data = dataclasses.replace(
        drill.data,
        requested=(RECOVERY,),
        scenarios={BASELINE: drill.data.scenarios[BASELINE], RECOVERY: forged},
        runs={BASELINE: drill.data.runs[BASELINE], RECOVERY: run},
        events=restore_events(forged, run),
    )
    checks = run_checks(data)
    statuses = {c.id: c.status for c in checks}
    assert statuses["exact_resume"] == FAIL, statuses
    exact = next(c for c in checks if c.id == "exact_resume")
    assert any(f"step {drifted}: loss" in p and "!= baseline" in p for p in exact.problems), exact
    assert statuses["retry_budget"] == statuses["fallback_no_commit"] == "skip"
    assert [c for c in checks if c.status == FAIL] == [exact]
    report = write_report(prepare_out(tmp_path / "out"), data, checks, plot_data(data), [])
    assert report.read_text().startswith("# Fault-recovery drill: FAIL (")
    result = DrillResult(checks, plot_data(data), report, data)
    assert result.exit_code == 1
    assert verdict_line(result).startswith("drill FAILED: exact_resume (")


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


def test_the_cli_carries_resume_extras_and_a_subset_of_scenarios(tmp_path: Path) -> None:
    """What a drill of the drill needs from the command line (the environment and overrides
    only launches that restore get)."""
    parser = argparse.ArgumentParser()
    add_args(parser)
    args = parser.parse_args(
        ["--out", str(tmp_path / "d"), "--scenarios", "recovery", "--resume-env",
         f"{SKIP_ENV}=I", "--resume-override", "train.seed=7", "recipe=gpt_tiny"]
    )  # fmt: skip
    cfg = config_from_args(args)
    assert cfg.scenarios == ("recovery",) and cfg.overrides == ("recipe=gpt_tiny",)
    assert cfg.resume == ResumeExtras({SKIP_ENV: "I"}, ("train.seed=7",))
