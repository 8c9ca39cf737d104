"""The chaos soak's verdict and report: every fault with its detection, RTO, lost and restored
steps; goodput measured against the planner's prediction; the final loss trajectory compared
bit for bit with the clean run. Writes ``soak.md`` and ``soak.png`` beside the runs."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from drill.soak.plan import IN_PLACE, PlannedFault, SoakRuns, clean_costs
from pretrain.context.run_dir import RunDir, read_jsonl
from resiliency.cli.capacity import predicted_goodput
from resiliency.monitor.goodput import Ledger, build_ledger, format_ledger
from resiliency.storage.layout import COMMITTED_NAME, RunLayout

REPORT_NAME, PLOT_NAME = "soak.md", "soak.png"


@dataclass
class FaultOutcome:
    fault: PlannedFault
    fired: bool = False
    cause: str = ""
    failing_rank: Any = None
    detection_s: float | None = None
    rto_s: float | None = None
    lost_steps: int | None = None
    restored_step: int | None = None


@dataclass
class Verdict:
    passed: bool
    summary: str
    bit_exact: bool  # every step's final loss equals the clean run's
    problems: list[str] = field(default_factory=list)
    outcomes: list[FaultOutcome] = field(default_factory=list)


def final_losses(run_dir: Path) -> dict[int, float]:
    """step -> loss of the last record of each step (re-trained steps overwrite)."""
    return {r["step"]: r["loss"] for r in read_jsonl(RunDir(run_dir).steps_metrics)}


def attempt_records(run_dir: Path) -> list[dict[str, Any]]:
    paths = sorted(RunDir(run_dir).attempts_dir.glob("attempt-*.json"))
    return [json.loads(p.read_text()) for p in paths]


def match_faults(faults: list[PlannedFault], records: list[dict[str, Any]]) -> list[FaultOutcome]:
    """Round r ran as the (r+1)-th attempt: a restart fault of round r is that attempt's
    failure (the next attempt's restore), an in-place one is a replay event in it."""
    outcomes = []
    for fault in faults:
        outcome = FaultOutcome(fault)
        record = records[fault.round] if fault.round < len(records) else {}
        if fault.kind in IN_PLACE:
            _in_place(outcome, record)
        elif record.get("status") == "failed":
            following = records[fault.round + 1] if fault.round + 1 < len(records) else {}
            rto = record.get("rto") or {}
            outcome.fired = True
            outcome.cause = record.get("failure_cause") or record.get("failure_class") or ""
            outcome.failing_rank = record.get("first_failing_rank")
            outcome.detection_s, outcome.rto_s = rto.get("detection_s"), rto.get("total_s")
            outcome.lost_steps = record.get("lost_steps")
            outcome.restored_step = following.get("restored_step")
        outcomes.append(outcome)
    return outcomes


def _in_place(outcome: FaultOutcome, record: dict[str, Any]) -> None:
    events = (record.get("guard") or {}).get("events") or []
    hit = [e for e in events if e.get("step") == outcome.fault.step and e.get("action")]
    if hit:
        event = hit[0]
        outcome.fired = True
        outcome.cause = f"{event.get('anomaly')} -> {event['action']}"
        outcome.failing_rank = "all (agreed)"
        outcome.detection_s = 0.0  # judged before the optimizer step of the same step
        outcome.restored_step = event.get("restored_step")
        if outcome.restored_step is not None:
            outcome.lost_steps = outcome.fault.step - 1 - outcome.restored_step


def compare(clean: dict[int, float], soak: dict[int, float], steps: int) -> list[str]:
    problems = []
    missing = [s for s in range(1, steps + 1) if s not in soak or s not in clean]
    if missing:
        problems.append(f"steps without a loss: {missing[:10]}")
    differ = [s for s in range(1, steps + 1) if s in soak and s in clean and soak[s] != clean[s]]
    if differ:
        s = differ[0]
        problems.append(
            f"{len(differ)} step(s) differ from the clean run, first {s}: "
            f"{soak[s]!r} != {clean[s]!r}"
        )
    return problems


@dataclass
class GoodputView:
    ledger: Ledger
    predicted: float | None
    interval_s: float
    save_s: float
    restart_s: float | None
    mtbf_s: float | None
    first_start_s: float = 0.0
    first_save_extra_s: float = 0.0
    in_flight_s: float = 0.0
    planned_mtbf_s: float | None = None  # seconds of training per fault, as planned


def goodput_view(runs: SoakRuns, outcomes: list[FaultOutcome]) -> GoodputView:
    """Measured goodput vs the planner's prediction, fed only what was known before the faults:
    the clean run's costs (mean blocking save, its start, the extra blocking of an attempt's
    first save, an async save's start -> commit) with a restart costing a start, and the fault
    rate the soak planned (``runs.planned_mtbf_s`` of training per fault). The soak's own
    recovery times and realised fault rate are shown beside, never fed in: a slow recovery or a
    fault that did not fire cannot move the prediction."""
    ledger = build_ledger(runs.run_dir("soak"))
    clean = runs.run_dir("clean")
    save_s, first_start_s = clean_costs(clean)
    rtos = [o.rto_s for o in outcomes if o.rto_s is not None]
    restart_s = statistics.fmean(rtos) if rtos else None
    fired = sum(o.fired for o in outcomes)
    mtbf_s = ledger.wall_s / fired if fired and ledger.wall_s else None
    interval_s = runs.save_every * runs.step_s
    view = GoodputView(ledger, None, interval_s, save_s, restart_s, mtbf_s, first_start_s)
    view.first_save_extra_s, view.in_flight_s = first_save_extra(clean), save_in_flight_s(clean)
    view.planned_mtbf_s = runs.planned_mtbf_s
    if runs.planned_mtbf_s:
        view.predicted = predicted_goodput(
            interval_s,
            save_s,
            first_start_s,  # a restart is a start of the job: the planner's own assumption
            runs.planned_mtbf_s,
            first_start_s=first_start_s,
            train_s=runs.steps * runs.step_s,
            first_save_extra_s=view.first_save_extra_s,
            in_flight_s=view.in_flight_s,
            mtbf_of_training=True,
        )
    return view


def first_save_extra(run_dir: Path) -> float:
    """What an attempt's first save blocks beyond a steady one: the staging dry run that
    sizes its buffers (once per attempt, tier ``staging``) and the first save's excess."""
    records = read_jsonl(RunDir(run_dir).checkpoint_metrics)
    staging = sum(r["blocked_s"] for r in records if r.get("tier") == "staging")
    saves = [r["blocked_s"] for r in records if r.get("tier") == "persistent"]
    excess = saves[0] - statistics.median(saves[1:]) if len(saves) > 1 else 0.0
    return staging + max(0.0, excess)


def save_in_flight_s(run_dir: Path) -> float:
    """The median time from a persistent save's start to its commit (the published step's
    COMMITTED file, from the file system): a fault in that window loses the save too."""
    windows = []
    layout = RunLayout.from_run_dir(run_dir)
    for record in read_jsonl(RunDir(run_dir).checkpoint_metrics):
        if record.get("tier") != "persistent":
            continue
        committed = layout.step_dir(record["step"]) / COMMITTED_NAME
        if committed.exists():
            started = record["time"] - record["blocked_s"]
            windows.append(max(0.0, committed.stat().st_mtime - started))
    return statistics.median(windows) if windows else 0.0


def judge(runs: SoakRuns) -> Verdict:
    records = attempt_records(runs.run_dir("soak"))
    outcomes = match_faults(runs.faults, records)
    problems = []
    for name in ("clean", "soak"):
        if runs.exits.get(name) != 0:
            problems.append(f"the {name} run exited {runs.exits.get(name)} (logs/{name}.log)")
    for o in outcomes:
        if not o.fired:
            problems.append(f"fault {o.fault.spec()} left no trace in attempt {o.fault.round + 1}")
    clean, soak = final_losses(runs.run_dir("clean")), final_losses(runs.run_dir("soak"))
    trajectory = compare(clean, soak, runs.steps)
    problems += trajectory
    kinds = sorted({o.fault.kind for o in outcomes if o.fired})
    summary = (
        f"soak {'PASSED' if not problems else 'FAILED'}: {sum(o.fired for o in outcomes)} "
        f"fault(s) of {len(kinds)} kind(s) ({', '.join(kinds)}) over {runs.steps} steps; "
        f"final trajectory {'DIFFERS' if trajectory else 'bit-exact'}"
        f"; report {runs.out / REPORT_NAME}"
    )
    verdict = Verdict(not problems, summary, not trajectory, problems, outcomes)
    view = goodput_view(runs, outcomes)
    write_markdown(runs, verdict, view, runs.out / REPORT_NAME)
    write_plot(runs, outcomes, clean, soak, runs.out / PLOT_NAME)
    (runs.out / "soak.json").write_text(json.dumps(_record(runs, verdict, view), indent=1))
    return verdict


def _record(runs: SoakRuns, verdict: Verdict, view: GoodputView) -> dict[str, Any]:
    plan = json.loads((runs.out / "soak.json").read_text())
    return {
        **plan,
        "passed": verdict.passed,
        "problems": verdict.problems,
        "outcomes": [
            {k: v for k, v in vars(o).items() if k != "fault"} | {"spec": o.fault.spec()}
            for o in verdict.outcomes
        ],
        "goodput": view.ledger.goodput,
        "goodput_predicted": view.predicted,
        "ledger": view.ledger.to_dict(),
        "costs": {
            "interval_s": view.interval_s,
            "save_s": view.save_s,
            "restart_s": view.restart_s,
            "mtbf_s": view.mtbf_s,
            "planned_mtbf_s": view.planned_mtbf_s,
            "first_start_s": view.first_start_s,
            "first_save_extra_s": view.first_save_extra_s,
            "in_flight_s": view.in_flight_s,
        },
    }


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def _fault_rows(outcomes: list[FaultOutcome]) -> list[str]:
    rows = [
        "| # | fault | step | rank | planned at | fired | cause | first failing rank "
        "| detection s | RTO s | lost steps | restored step |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for i, o in enumerate(outcomes, 1):
        f = o.fault
        cells = [
            i,
            f.kind,
            f.step,
            f.rank,
            f"{f.at_s:.0f} s",
            "yes" if o.fired else "**no**",
            o.cause.replace("|", "/"),
            o.failing_rank,
            _fmt(o.detection_s),
            _fmt(o.rto_s),
            _fmt(o.lost_steps),
            _fmt(o.restored_step),
        ]
        rows.append("| " + " | ".join(str(c) for c in cells) + " |")
    return rows


def _goodput_lines(view: GoodputView) -> list[str]:
    measured = view.ledger.goodput
    ratio = measured / view.predicted if measured is not None and view.predicted else None
    return [
        "## Goodput",
        "",
        f"- measured: **{_fmt(measured and 100 * measured)} %** of the soak's wall time",
        f"- predicted by the planner (Young/Daly, `resiliency.cli.capacity.predicted_goodput`) "
        f"from the clean run's costs and the planned fault rate: "
        f"{_fmt(view.predicted and 100 * view.predicted)} % (save every "
        f"{view.interval_s:.1f} s of training, blocking save {view.save_s:.2f} s, first start "
        f"{view.first_start_s:.2f} s and a restart costing the same, an attempt's first save "
        f"+{view.first_save_extra_s:.2f} s, save in flight {view.in_flight_s:.2f} s, a fault "
        f"every {_fmt(view.planned_mtbf_s)} s of training)",
        f"- measured in the soak, not fed to the prediction: mean RTO "
        f"{_fmt(view.restart_s, 2)} s, a fault every {_fmt(view.mtbf_s)} s of wall",
        f"- measured / predicted: {_fmt(ratio, 3)}",
        "",
        "```",
        format_ledger(view.ledger),
        "```",
    ]


def write_markdown(runs: SoakRuns, verdict: Verdict, view: GoodputView, path: Path) -> None:
    lines = [
        "# Chaos soak",
        "",
        f"**{verdict.summary}**",
        "",
        f"- seed {runs.seed} (rerun: `--seed {runs.seed}`), {runs.steps} steps of "
        f"{runs.step_s:.2f} s (probe), a save every {runs.save_every} steps",
        f"- wall: clean {_fmt(runs.wall_s.get('clean'))} s, soak {_fmt(runs.wall_s.get('soak'))} s"
        + (f"; planned MTBF {runs.mtbf_s:.1f} s of training" if runs.mtbf_s else ""),
        f"- overrides: `{' '.join(runs.overrides)}`",
        "",
        *(f"- problem: {p}" for p in verdict.problems),
        "",
        "## Faults",
        "",
        *_fault_rows(verdict.outcomes),
        "",
        *_goodput_lines(view),
        "",
        "## Trajectory",
        "",
        "The final loss of every step (the last record of a re-trained step) against the clean "
        "run, compared as floats for equality: "
        + ("bit-exact." if verdict.bit_exact else "**differs** (see problems)."),
        "",
        f"![loss]({PLOT_NAME})",
    ]
    path.write_text("\n".join(lines) + "\n")


def write_plot(
    runs: SoakRuns,
    outcomes: list[FaultOutcome],
    clean: dict[int, float],
    soak: dict[int, float],
    path: Path,
) -> None:
    # heavy: only the report plot needs it
    import matplotlib

    matplotlib.use("Agg")  # files only: no display, safe in batch jobs
    # heavy: only the report plot needs it
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6.5), gridspec_kw={"height_ratios": [3, 2]})
    top.plot(sorted(clean), [clean[s] for s in sorted(clean)], label="clean run", lw=2)
    top.plot(sorted(soak), [soak[s] for s in sorted(soak)], "o", ms=3, label="soak (final)")
    for o in outcomes:
        top.axvline(o.fault.step, color="red" if o.fired else "grey", alpha=0.3, lw=1)
        top.annotate(
            o.fault.kind,
            (o.fault.step, top.get_ylim()[1]),
            rotation=90,
            fontsize=7,
            va="top",
            ha="right",
        )
    top.set_xlabel("step")
    top.set_ylabel("loss")
    top.legend()
    records = read_jsonl(RunDir(runs.run_dir("soak")).steps_metrics)
    if records:
        t0 = min(r["time"] for r in records)
        bottom.plot([r["time"] - t0 for r in records], [r["step"] for r in records], ".", ms=3)
    bottom.set_xlabel("wall time of the soak run (s)")
    bottom.set_ylabel("step trained")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
