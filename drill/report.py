"""The drill's report: report.md (checklist, runs, timings, per-step comparison) and loss.png."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from drill.acceptance import ACCEPTANCE_IDS, FAIL, PASS, CheckResult, DrillData
from drill.run_records import (
    FailureTiming,
    RestoreEvent,
    failure_timing,
    load_seconds,
    percentile,
    read_log,
)
from drill.runs import BASELINE, BUDGET, NO_COMMIT, NO_SHARD, RECOVERY
from launch.retry_policy import REQUEUE, Decision

REPORT_NAME, PLOT_NAME, JSON_NAME = "report.md", "loss.png", "drill.json"
_MARK = {PASS: "PASS", FAIL: "**FAIL**", "skip": "skip"}


@dataclass(frozen=True)
class Curve:
    label: str
    steps: tuple[int, ...]
    values: tuple[float, ...]


@dataclass(frozen=True)
class PlotData:
    baseline: Curve
    recovered: Curve  # the recovered run's final trajectory (the last record of each step)
    attempts: tuple[Curve, ...]  # each attempt's own records, redone steps included
    restores: tuple[tuple[int, int], ...]  # (attempt, restored step)
    failures: tuple[tuple[int, float], ...]  # (last step, its loss) of each failed attempt


def _curve(label: str, records: dict[int, float]) -> Curve:
    steps = tuple(sorted(records))
    return Curve(label, steps, tuple(records[s] for s in steps))


def plot_data(d: DrillData) -> PlotData:
    baseline = _curve("baseline (no fault)", {s: r.loss for s, r in d.baseline.items()})
    run = d.runs.get(RECOVERY)
    if run is None:
        return PlotData(baseline, Curve("recovered", (), ()), (), (), ())
    attempts, restores, failures = [], [], []
    for view in run.attempts.values():
        restored = view.restored_step
        label = f"attempt {view.attempt}" + (f" (restored step {restored})" if restored else "")
        attempts.append(
            Curve(label, tuple(r.step for r in view.steps), tuple(r.loss for r in view.steps))
        )
        if restored:
            restores.append((view.attempt, restored))
        if view.record.get("status") != "finished" and view.last_step is not None:
            failures.append((view.last_step.step, view.last_step.loss))
    recovered = _curve("recovered", {s: r.loss for s, r in run.steps.items()})
    return PlotData(baseline, recovered, tuple(attempts), tuple(restores), tuple(failures))


def write_plot(plot: PlotData, path: Path) -> None:
    # heavy: only the report plot needs it
    import matplotlib

    matplotlib.use("Agg")  # files only: no display, safe in batch jobs
    # heavy: only the report plot needs it
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(9, 6.5), sharex=True, gridspec_kw={"height_ratios": [3, 1]}
    )
    _draw_losses(top, plot)
    _draw_difference(bottom, plot)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _draw_losses(ax, plot: PlotData) -> None:  # noqa: ANN001 - matplotlib Axes
    ax.plot(
        plot.baseline.steps,
        plot.baseline.values,
        color="0.7",
        linewidth=6,
        solid_capstyle="round",
        label=plot.baseline.label,
        zorder=1,
    )
    for i, curve in enumerate(plot.attempts):
        ax.plot(
            curve.steps,
            curve.values,
            marker="o",
            markersize=3.5,
            linewidth=1.4,
            color=f"C{i}",
            label=curve.label,
            zorder=2 + i,
        )
    recovered = dict(zip(plot.recovered.steps, plot.recovered.values))
    points = [(step, recovered[step]) for _, step in plot.restores if step in recovered]
    if points:
        ax.scatter(
            *zip(*points), marker="D", s=45, color="black", zorder=19, label="checkpoint restored"
        )
    for attempt, step in plot.restores:
        ax.axvline(step, color="0.35", linestyle=":", linewidth=1)
        ax.annotate(
            f"restore @ {step}\n(attempt {attempt})",
            (step, 1),
            xycoords=("data", "axes fraction"),
            xytext=(3, -3),
            textcoords="offset points",
            va="top",
            fontsize=8,
            color="0.3",
        )
    if plot.failures:
        steps, losses = zip(*plot.failures)
        ax.scatter(
            steps,
            losses,
            marker="X",
            s=90,
            color="crimson",
            zorder=20,
            label="killed after this step",
        )
    ax.set_ylabel("loss")
    ax.set_title("Training loss: no-fault baseline vs. killed-and-recovered run")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper right")


def _draw_difference(ax, plot: PlotData) -> None:  # noqa: ANN001 - matplotlib Axes
    base = dict(zip(plot.baseline.steps, plot.baseline.values))
    pairs = [
        (s, v - base[s]) for s, v in zip(plot.recovered.steps, plot.recovered.values) if s in base
    ]
    if pairs:
        steps, diffs = zip(*pairs)
        ax.plot(steps, diffs, marker="o", markersize=3, color="C3")
        exact = not any(diffs)
        ax.text(
            0.01,
            0.9,
            "bit-exact: every step equals the baseline"
            if exact
            else f"max |diff| {max(abs(x) for x in diffs):.3e}",
            transform=ax.transAxes,
            fontsize=8,
            va="top",
        )
    for _, step in plot.restores:
        ax.axvline(step, color="0.35", linestyle=":", linewidth=1)
    ax.axhline(0, color="0.5", linewidth=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("recovered - baseline")
    ax.grid(alpha=0.3)


# ---------------------------------------------------------------- markdown


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _table(header: list[str], rows: list[list[object]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]


def _check_rows(checks: list[CheckResult], start: int) -> list[list[object]]:
    rows = []
    for i, c in enumerate(checks, start):
        detail = "<br>".join([*(f"✗ {p}" for p in c.problems), *c.evidence])
        rows.append([i, f"{c.title} (`{c.id}`)", _MARK[c.status], detail])
    return rows


def _checklist(checks: list[CheckResult]) -> list[str]:
    acceptance = [c for c in checks if c.id in ACCEPTANCE_IDS]
    drill = [c for c in checks if c.id not in ACCEPTANCE_IDS]
    header = ["#", "Item", "Result", "Evidence"]
    return [
        "## Acceptance evidence (recovery is more than a process Running again)",
        "",
        *_table(header, _check_rows(acceptance, 1)),
        "",
        "## Fault experiment: broken checkpoints, retry budget, old world",
        "",
        *_table(header, _check_rows(drill, len(acceptance) + 1)),
        "",
    ]


def _runs_table(d: DrillData) -> list[str]:
    rows = []
    for scenario in d.scenarios.values():
        for i, launch in enumerate(scenario.launches):
            attempt = scenario.attempts[i]
            view = d.runs[scenario.name].attempts.get(attempt) if attempt else None
            decision = scenario.decisions[i]
            restored = view.restored_step if view else None
            rows.append(
                [
                    scenario.name,
                    i,
                    scenario.faults[i] or "-",
                    (scenario.damage or "-") if i == 0 else "-",
                    launch.returncode,
                    attempt or "-",
                    "-" if restored is None else restored,
                    _decision_text(decision),
                    f"{launch.end - launch.start:.1f} s",
                    f"`{launch.spec.log_path.parent.name}/{launch.spec.log_path.name}`",
                ]
            )
    header = [
        "Scenario",
        "Launch",
        "Fault",
        "Damage",
        "Exit",
        "Attempt",
        "Restored step",
        "Retry policy",
        "Wall",
        "Log",
    ]
    note = (
        []
        if d.launcher == "local"
        else [
            "Exit is the batch job's: its in-job retry policy runs with no requeues "
            "(`launch.slurm.max_requeues=0`), so failed launches exit 7; the drill's own "
            "retry policy column decides.",
            "",
        ]
    )
    return ["## Runs", "", *note, *_table(header, rows), ""]


def _decision_text(decision: Decision | None) -> str:
    if decision is None:
        return "-"
    if decision.action == REQUEUE:
        return decision.reason  # "requeue k of n: why"
    return f"stop, exit {decision.exit_code}: {decision.reason}"


def _fmt_s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def timings(d: DrillData) -> list[FailureTiming]:
    scenario = d.scenarios.get(RECOVERY)
    if scenario is None:
        return []
    found = []
    for ev in d.events:
        if ev.scenario == RECOVERY:
            timing = failure_timing(ev, scenario.faults[ev.launch - 1])
            if timing is not None:
                found.append(timing)
    return found


def _save_durations(d: DrillData) -> list[float]:
    return [
        seconds
        for name, s in d.scenarios.items()
        if name != BASELINE
        for launch in s.launches
        for _, seconds in read_log(launch.spec.log_path).saves
    ]


def _load_durations(events: list[RestoreEvent]) -> list[float]:
    return [x for ev in events if ev.attempt and (x := load_seconds(ev.attempt)) is not None]


def _timings_section(d: DrillData) -> list[str]:
    rows = [
        [
            t.fault,
            t.last_step,
            t.restored_step,
            t.lost_steps,
            _fmt_s(t.detect_s),
            _fmt_s(t.restart_s),
            _fmt_s(t.load_s),
            _fmt_s(t.rto_s),
            _fmt_s(t.catch_up_s),
        ]
        for t in timings(d)
    ]
    header = [
        "Failure",
        "Last step done",
        "Restored",
        "Lost steps",
        "Detect + exit",
        "Restart",
        "Load",
        "RTO (first new step)",
        "Lost work redone",
    ]
    saves, loads = _save_durations(d), _load_durations(d.events)
    summary = [
        [
            "checkpoint save",
            len(saves),
            _fmt_s(percentile(saves, 0.5)),
            _fmt_s(percentile(saves, 0.95)),
        ],
        [
            "load (attempt start to first step: build + restore)",
            len(loads),
            _fmt_s(percentile(loads, 0.5)),
            _fmt_s(percentile(loads, 0.95)),
        ],
    ]
    return [
        "## Lost work and recovery time",
        "",
        "Failure time is the last step the killed attempt logged; detect + exit ends when "
        "its launcher has exited, restart when the new attempt records its start, load "
        "when its first step begins.",
        "",
        *_table(header, rows),
        "",
        *_table(["Operation", "Samples", "P50", "P95"], summary),
        "",
    ]


def _comparison_section(d: DrillData) -> list[str]:
    rows = []
    for ev in d.events:
        restored = ev.attempt.restored_step if ev.attempt else None
        if restored is None or ev.attempt is None:
            continue
        for r in ev.attempt.steps:
            base = d.baseline.get(r.step)
            if base is None or not restored < r.step <= restored + d.window:
                continue
            rows.append(
                [
                    f"{ev.scenario} #{ev.launch}",
                    r.step,
                    f"{base.loss:.6f}",
                    f"{r.loss:.6f}",
                    f"{r.loss - base.loss:+.1e}",
                    f"{base.grad_norm:.5f}",
                    f"{r.grad_norm:.5f}",
                    "yes" if r.lr == base.lr else f"{r.lr:.4e}",
                ]
            )
    header = [
        "Restore",
        "Step",
        "Baseline loss",
        "Recovered loss",
        "Diff",
        "Baseline grad norm",
        "Recovered grad norm",
        "LR equal",
    ]
    return [
        f"## Steps after each restore vs. the baseline (window {d.window})",
        "",
        *_table(header, rows),
        "",
    ]


def _header(d: DrillData, checks: list[CheckResult], overrides: list[str]) -> list[str]:
    failed = [c.id for c in checks if c.status == FAIL]
    verdict = "PASS" if not failed else f"FAIL ({', '.join(failed)})"
    return [
        f"# Fault-recovery drill: {verdict}",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M:%S')}; launcher {d.launcher}, {d.nproc} ranks; "
        f"overrides: "
        f"`{' '.join(overrides)}`",
        "",
        _plan_line(d),
        "",
        f"![loss: baseline vs recovered]({PLOT_NAME})",
        "",
    ]


def _plan_line(d: DrillData) -> str:
    p = d.plan
    parts = [
        f"Plan: {p.steps} steps, checkpoint every {p.save_every}, retry budget {p.max_retries}"
    ]
    if RECOVERY in d.requested:
        parts.append(
            f"SIGKILL rank {p.fault_rank} before step(s) "
            f"{', '.join(map(str, p.kills))}, one kill per launch"
        )
    if NO_COMMIT in d.requested or NO_SHARD in d.requested:
        parts.append(
            "newest step broken in copies of the recovered run (no COMMITTED; a missing shard)"
        )
    if BUDGET in d.requested:
        parts.append(f"{p.max_retries + 1} consecutive kills before step {p.budget_kill}")
    return "; ".join(parts) + "."


def write_report(
    out: Path, d: DrillData, checks: list[CheckResult], plot: PlotData, overrides: list[str]
) -> Path:
    write_plot(plot, out / PLOT_NAME)
    lines = [
        *_header(d, checks, overrides),
        *_checklist(checks),
        *_timings_section(d),
        *_runs_table(d),
        *_comparison_section(d),
    ]
    path = out / REPORT_NAME
    path.write_text("\n".join(lines))
    (out / JSON_NAME).write_text(
        json.dumps(
            {
                "checks": [asdict(c) for c in checks],
                "timings": [asdict(t) for t in timings(d)],
                "plot": asdict(plot),
            },
            indent=1,
        )
    )
    return path
