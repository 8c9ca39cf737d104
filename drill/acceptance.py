"""The acceptance checklist: one function per item, each judging the evidence of the runs.

Items 1-7 are the recovery acceptance evidence (section 12 of the fault-tolerance notes:
recovery is accepted on evidence, not on the process running again); items 8-11 are the rest
of the minimal repeatable fault experiment (section 17).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from drill.run_records import RestoreEvent, RunEvidence, StepRecord
from drill.runs import BASELINE, BUDGET, NO_COMMIT, NO_SHARD, RECOVERY, DrillPlan, Scenario
from launch.retry_policy import REQUEUE, STOP
from pretrain.context import exit_codes
from resiliency.storage.checksum import file_checksum
from resiliency.storage.layout import RunLayout
from resiliency.storage.manifest import ManifestError, read_manifest
from resiliency.storage.verify import verify_step_dir

PASS, FAIL, SKIP = "pass", "fail", "skip"
MAX_PROBLEMS_PER_EVENT = 3


@dataclass
class DrillData:
    plan: DrillPlan
    launcher: str
    nproc: int
    global_batch: int
    seq_length: int
    data_fingerprint: dict[str, Any]
    window: int
    tolerance: float
    final_tolerance: float
    requested: tuple[str, ...]
    scenarios: dict[str, Scenario]
    runs: dict[str, RunEvidence]
    events: list[RestoreEvent]

    @property
    def baseline(self) -> dict[int, StepRecord]:
        return self.runs[BASELINE].steps


@dataclass
class CheckResult:
    id: str
    title: str
    status: str
    evidence: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


TITLES = {
    "restore_step": "First step after restore equals the manifest step (not 0)",
    "optimizer_lr": "Optimizer state non-empty; LR equal to before the failure",
    "data_position": "Dataset snapshot, sample watermark and consumed tokens are correct",
    "exact_resume": "No loss/grad-norm jump after restore: loss, grad norm and LR equal the "
    "no-fault baseline in the window after each restore",
    "ranks_same_step": "All ranks at the same step: a rank-state file for every rank in each "
    "checkpoint",
    "new_attempt_checkpoint": "The first checkpoint written by the new attempt restores "
    "independently",
    "final_result": "Final result within tolerance of the no-fault baseline",
    "fallback_no_commit": "Newest step without COMMITTED is rejected; the previous verified "
    "step is used",
    "fallback_missing_shard": "Newest step missing a shard is rejected; the previous verified "
    "step is used",
    "retry_budget": "Consecutive infrastructure failures exhaust the retry budget: stop with "
    "RETRY_BUDGET_EXHAUSTED",
    "old_world_exited": "The old worker group exited: no rank outlives its launch",
}


def _judge(id_: str, evidence: list[str], problems: list[str]) -> CheckResult:
    if not evidence and not problems:
        problems = ["no evidence was produced"]
    return CheckResult(id_, TITLES[id_], FAIL if problems else PASS, evidence, problems)


def _skipped(id_: str, why: str) -> CheckResult:
    return CheckResult(id_, TITLES[id_], SKIP, [why])


def close(a: float, b: float, tol: float) -> bool:
    """Equal within a relative tolerance; tolerance 0 means bit-exact."""
    return a == b if tol == 0 else math.isclose(a, b, rel_tol=tol)


def _step_dir(run_dir: Path, step: int) -> Path:
    return RunLayout.from_run_dir(run_dir).step_dir(step)


def _train_state(step_dir: Path) -> dict[str, Any]:
    # torch: the drill itself never loads it otherwise
    from resiliency.checkpoint.rank_state import read_train_state

    return read_train_state(step_dir)


def _label(ev: RestoreEvent) -> str:
    return f"{ev.scenario} launch {ev.launch}"


def _restored(ev: RestoreEvent) -> int | None:
    return ev.attempt.restored_step if ev.attempt is not None else None


def optimizer_state_numel(model_dir: Path) -> dict[str, int]:
    """Elements of Adam moments (and other optimizer entries) in a dist-checkpoint's metadata."""
    # torch: the drill itself never loads it otherwise
    from torch.distributed.checkpoint import FileSystemReader

    from pretrain.platform.compat import restrict_checkpoint_loads

    restrict_checkpoint_loads()  # .metadata is a pickle: only the admitted globals load
    totals = {"exp_avg": 0, "exp_avg_sq": 0, "other": 0}
    metadata = FileSystemReader(str(model_dir)).read_metadata().state_dict_metadata
    for key, meta in metadata.items():
        if not key.startswith("optimizer."):
            continue
        parts = key.replace("/", ".").split(".")
        kind = (
            "exp_avg_sq" if "exp_avg_sq" in parts else "exp_avg" if "exp_avg" in parts else "other"
        )
        size = getattr(meta, "size", None)
        totals[kind] += math.prod(size) if size is not None else 1
    return totals


# ---------------------------------------------------------------- 1. restore step


def check_restore_step(d: DrillData) -> CheckResult:
    evidence: list[str] = []
    problems: list[str] = []
    for ev in d.events:
        problems += _restore_step_problems(d, ev, evidence)
    return _judge("restore_step", evidence, problems)


def _restore_step_problems(d: DrillData, ev: RestoreEvent, evidence: list[str]) -> list[str]:
    restored = _restored(ev)
    if ev.attempt is None:
        return [f"{_label(ev)}: no attempt record"]
    if restored != ev.expected_step:
        return [f"{_label(ev)}: restored step {restored}, expected {ev.expected_step}"]
    step_dir = _step_dir(d.scenarios[ev.scenario].run_dir, restored)
    manifest_step = read_manifest(step_dir).step
    state_step = _train_state(step_dir)["step"]
    first = ev.attempt.steps[0].step if ev.attempt.steps else None
    evidence.append(
        f"{_label(ev)}: attempt {ev.attempt.attempt} restored {step_dir.name} "
        f"(manifest step {manifest_step}, train_state step {state_step}); first "
        f"step trained: {first}"
    )
    problems = []
    if not manifest_step == state_step == restored:
        problems.append(
            f"{_label(ev)}: manifest/train_state steps {manifest_step}/{state_step} "
            f"!= restored {restored}"
        )
    if first != restored + 1:
        problems.append(f"{_label(ev)}: first step after restore is {first}, not {restored + 1}")
    if (step_dir.name, restored) not in ev.log.resumed:
        problems.append(f"{_label(ev)}: log lacks 'resumed from {step_dir.name}'")
    return problems


# ---------------------------------------------------------------- 2. optimizer and LR


def check_optimizer_lr(d: DrillData) -> CheckResult:
    evidence: list[str] = []
    problems: list[str] = []
    for ev in d.events:
        if _restored(ev) is None:
            problems.append(f"{_label(ev)}: nothing was restored")
            continue
        problems += _optimizer_problems(d, ev, evidence) + _lr_problems(d, ev, evidence)
    return _judge("optimizer_lr", evidence, problems)


def _optimizer_problems(d: DrillData, ev: RestoreEvent, evidence: list[str]) -> list[str]:
    restored = _restored(ev)
    assert restored is not None
    model_dir = _step_dir(d.scenarios[ev.scenario].run_dir, restored) / "model"
    numel = optimizer_state_numel(model_dir)
    evidence.append(
        f"{_label(ev)}: step {restored} holds Adam moments exp_avg "
        f"{numel['exp_avg']} + exp_avg_sq {numel['exp_avg_sq']} elements"
    )
    problems = []
    if not (numel["exp_avg"] and numel["exp_avg_sq"]):
        problems.append(f"{_label(ev)}: checkpoint step {restored} has no Adam moments")
    if ev.log.fresh_optimizer:
        problems.append(f"{_label(ev)}: restored weights only, with a FRESH optimizer")
    return problems


def _lr_problems(d: DrillData, ev: RestoreEvent, evidence: list[str]) -> list[str]:
    restored = _restored(ev)
    assert restored is not None and ev.attempt is not None
    saved_lr = _train_state(_step_dir(d.scenarios[ev.scenario].run_dir, restored))["lr"]
    base = d.baseline.get(restored)
    problems = []
    if base is None or not close(saved_lr, base.lr, d.tolerance):
        problems.append(
            f"{_label(ev)}: saved lr {saved_lr} != baseline lr at step {restored} "
            f"({base.lr if base else 'missing'})"
        )
    if not ev.attempt.steps:
        return problems + [f"{_label(ev)}: no step trained after restore"]
    first = ev.attempt.steps[0]
    before = _logged_before(ev, first.step)
    evidence.append(
        f"{_label(ev)}: lr saved {saved_lr:.6e}; step {first.step} lr "
        f"{first.lr:.6e} (before the failure: "
        f"{f'{before.lr:.6e}' if before else 'not reached'})"
    )
    reference = d.baseline.get(first.step)
    if reference is None or not close(first.lr, reference.lr, d.tolerance):
        problems.append(
            f"{_label(ev)}: step {first.step} lr {first.lr} != baseline "
            f"{reference.lr if reference else 'missing'}"
        )
    if before is not None and not close(first.lr, before.lr, d.tolerance):
        problems.append(
            f"{_label(ev)}: step {first.step} lr {first.lr} != {before.lr} before the failure"
        )
    return problems


def _logged_before(ev: RestoreEvent, step: int) -> StepRecord | None:
    if ev.previous is None:
        return None
    return next((r for r in ev.previous.steps if r.step == step), None)


# ---------------------------------------------------------------- 3. data position


def check_data_position(d: DrillData) -> CheckResult:
    evidence: list[str] = []
    problems: list[str] = []
    snapshots = set()
    for name in (RECOVERY, NO_COMMIT, NO_SHARD):
        if name not in d.scenarios:
            continue
        layout = RunLayout.from_run_dir(d.scenarios[name].run_dir)
        for step in layout.published_steps():
            problems += _position_problems(d, name, layout.step_dir(step), step, evidence)
            snapshots.add(repr(sorted(read_manifest(layout.step_dir(step)).dataset.items())))
    if len(snapshots) > 1:
        problems.append(f"{len(snapshots)} different dataset snapshots across checkpoints")
    return _judge("data_position", evidence, problems)


def _position_problems(
    d: DrillData, scenario: str, step_dir: Path, step: int, evidence: list[str]
) -> list[str]:
    state = _train_state(step_dir)
    samples, tokens = step * d.global_batch, step * d.global_batch * d.seq_length
    found = (
        state["consumed_samples"],
        state["data_cursor"]["consumed_samples"],
        state["consumed_tokens"],
    )
    evidence.append(
        f"{scenario} {step_dir.name}: consumed_samples {found[0]}, cursor "
        f"{found[1]}, tokens {found[2]} (expected {samples}, {samples}, {tokens})"
    )
    problems = []
    if found != (samples, samples, tokens):
        problems.append(
            f"{scenario} {step_dir.name}: samples/cursor/tokens {found} != "
            f"({samples}, {samples}, {tokens}) = step x global batch (x seq)"
        )
    problems += _snapshot_problems(
        f"{scenario} {step_dir.name}", read_manifest(step_dir).dataset, d.data_fingerprint
    )
    return problems


def _snapshot_problems(
    label: str, dataset: dict[str, Any], fingerprint: dict[str, Any]
) -> list[str]:
    recorded = {k: v for k, v in dataset.items() if k != "index_files"}
    problems = []
    if recorded != fingerprint:
        problems.append(f"{label}: dataset snapshot {recorded} != configured {fingerprint}")
    for path, checksum in dataset.get("index_files", {}).items():
        if not Path(path).is_file() or file_checksum(Path(path)) != checksum:
            problems.append(f"{label}: index file {path} changed since the checkpoint")
    return problems


# ---------------------------------------------------------------- 4. no jump (exact resume)


def check_exact_resume(d: DrillData) -> CheckResult:
    evidence: list[str] = []
    problems: list[str] = []
    for ev in d.events:
        problems += _window_problems(d, ev, evidence)
    tol = "bit-exact" if d.tolerance == 0 else f"relative tolerance {d.tolerance:g}"
    evidence.insert(0, f"window: up to {d.window} steps after each restore, {tol}")
    return _judge("exact_resume", evidence, problems)


def _window_problems(d: DrillData, ev: RestoreEvent, evidence: list[str]) -> list[str]:
    restored = _restored(ev)
    if restored is None or ev.attempt is None:
        return [f"{_label(ev)}: nothing was restored"]
    window = [r for r in ev.attempt.steps if restored < r.step <= restored + d.window]
    if not window:
        return [f"{_label(ev)}: no step trained after restoring step {restored}"]
    problems = [p for r in window for p in _step_mismatch(d, r)]
    evidence.append(
        f"{_label(ev)}: steps {window[0].step}-{window[-1].step} after restoring "
        f"step {restored}: {len(window) - len({p.split(':')[0] for p in problems})}"
        f"/{len(window)} equal the baseline"
    )
    return [f"{_label(ev)}: {p}" for p in problems[:MAX_PROBLEMS_PER_EVENT]] + (
        [f"{_label(ev)}: ... {len(problems) - MAX_PROBLEMS_PER_EVENT} more mismatches"]
        if len(problems) > MAX_PROBLEMS_PER_EVENT
        else []
    )


def _step_mismatch(d: DrillData, record: StepRecord) -> list[str]:
    base = d.baseline.get(record.step)
    if base is None:
        return [f"step {record.step}: missing from the baseline"]
    problems = []
    for name in ("loss", "grad_norm", "lr"):
        ours, theirs = getattr(record, name), getattr(base, name)
        if not close(ours, theirs, d.tolerance):
            problems.append(
                f"step {record.step}: {name} {ours!r} != baseline {theirs!r} "
                f"(diff {ours - theirs:+.3e})"
            )
    return problems


# ---------------------------------------------------------------- 5. ranks at the same step


def check_ranks(d: DrillData) -> CheckResult:
    # torch: the drill itself never loads it otherwise
    from resiliency.checkpoint.rank_state import rank_state_path

    evidence: list[str] = []
    problems: list[str] = []
    for name in (RECOVERY, NO_COMMIT, NO_SHARD):
        if name not in d.scenarios:
            continue
        layout = RunLayout.from_run_dir(d.scenarios[name].run_dir)
        for step in layout.published_steps():
            step_dir = layout.step_dir(step)
            manifest = read_manifest(step_dir)
            ranks = [
                r for r in range(manifest.world_size) if rank_state_path(step_dir, r).is_file()
            ]
            evidence.append(
                f"{name} {step_dir.name}: rank-state for ranks {ranks} of "
                f"world size {manifest.world_size}"
            )
            if manifest.world_size != d.nproc or len(ranks) != d.nproc:
                problems.append(
                    f"{name} {step_dir.name}: {len(ranks)} rank-state file(s), "
                    f"world size {manifest.world_size}, expected {d.nproc}"
                )
            if not manifest.step == _train_state(step_dir)["step"] == step:
                problems.append(f"{name} {step_dir.name}: manifest/train_state step mismatch")
    return _judge("ranks_same_step", evidence, problems)


# ---------------------------------------------------------------- 6. new attempt's checkpoint


def check_new_attempt_checkpoint(d: DrillData) -> CheckResult:
    events = [ev for ev in d.events if ev.scenario == RECOVERY and ev.attempt is not None]
    if not events:
        return _judge("new_attempt_checkpoint", [], ["no restore in the recovery run"])
    run_dir = d.scenarios[RECOVERY].run_dir
    writer = events[0].attempt
    assert writer is not None
    written = _steps_written_by(run_dir, writer.attempt)
    if not written:
        return _judge(
            "new_attempt_checkpoint", [], [f"attempt {writer.attempt} published no checkpoint"]
        )
    first = written[0]
    verdict = verify_step_dir(_step_dir(run_dir, first), run_dir.name, full=True)
    later = [ev for ev in events[1:] if _restored(ev) == first]
    evidence = [f"attempt {writer.attempt} first published step {first}: {verdict.reason}"]
    evidence += [
        f"attempt {ev.attempt.attempt} restored it and trained {len(ev.attempt.steps)} step(s)"
        for ev in later
        if ev.attempt
    ]
    problems = [] if verdict.ok else [f"step {first} fails verification: {verdict.reason}"]
    if not any(ev.attempt and ev.attempt.steps for ev in later):
        problems.append(f"no later attempt restored step {first} and trained from it")
    return _judge("new_attempt_checkpoint", evidence, problems)


def _steps_written_by(run_dir: Path, attempt: int) -> list[int]:
    layout = RunLayout.from_run_dir(run_dir)
    written = []
    for step in layout.published_steps():
        try:
            if read_manifest(layout.step_dir(step)).attempt == attempt:
                written.append(step)
        except ManifestError:
            continue
    return written


# ---------------------------------------------------------------- 7. final result


def check_final_result(d: DrillData) -> CheckResult:
    scenario, run = d.scenarios[RECOVERY], d.runs[RECOVERY]
    steps, n = run.steps, d.plan.steps
    problems = []
    if not scenario.finished:
        last = scenario.decisions[-1] if scenario.decisions else None
        problems.append(f"recovery run did not finish: {last.line() if last else 'no launch'}")
    if sorted(steps) != list(range(1, n + 1)):
        problems.append(f"recovered run logged steps {sorted(steps)}, expected 1..{n}")
    if n not in steps or n not in d.baseline:
        return _judge("final_result", [], problems + [f"step {n} missing"])
    ours, base = steps[n].loss, d.baseline[n].loss
    evidence = [
        f"step {n}: loss {ours:.6f} vs baseline {base:.6f} (relative diff "
        f"{abs(ours - base) / abs(base):.2e}, tolerance {d.final_tolerance:g}); "
        f"{len(scenario.launches)} launch(es), last: {scenario.decisions[-1].line()}"
    ]
    if not close(ours, base, d.final_tolerance):
        problems.append(f"final loss {ours} outside {d.final_tolerance:g} of baseline {base}")
    return _judge("final_result", evidence, problems)


# ---------------------------------------------------------------- 8, 9. broken newest step


def check_fallback(d: DrillData, name: str) -> CheckResult:
    id_ = "fallback_no_commit" if name == NO_COMMIT else "fallback_missing_shard"
    scenario = d.scenarios.get(name)
    if scenario is None or not scenario.launches:
        return _judge(id_, [], [f"{name} was not run (the recovery run must finish)"])
    ev = ([e for e in d.events if e.scenario == name] or [None])[-1]  # the restart that ran
    broken = _step_dir(scenario.run_dir, d.plan.steps).name
    keyword = "COMMITTED" if name == NO_COMMIT else "is missing"
    rejected = [
        reason
        for dir_name, reason in (ev.log.skipped if ev else ())
        if dir_name == broken and keyword in reason
    ]
    evidence = [
        f"{scenario.damage}; restart log: skipping {broken}: "
        f"{rejected[0] if rejected else '(not logged)'}; attempt record restored_step "
        f"{_restored(ev) if ev else None}"
    ]
    problems = []
    if not rejected:
        problems.append(f"the restart did not log rejecting {broken} ({keyword})")
    if ev is None or _restored(ev) != scenario.expected_restores[0]:
        problems.append(
            f"restored step {_restored(ev) if ev else None}, expected "
            f"{scenario.expected_restores[0]}"
        )
    if not scenario.finished:
        last = scenario.decisions[-1]
        problems.append(f"restart did not finish: {last.line() if last else 'no decision'}")
    return _judge(id_, evidence, problems)


# ---------------------------------------------------------------- 10. retry budget


def check_retry_budget(d: DrillData) -> CheckResult:
    scenario, budget = d.scenarios[BUDGET], d.plan.max_retries
    decisions = [dec for dec in scenario.decisions if dec is not None]
    evidence = [f"{len(scenario.launches)} launch(es) for a budget of {budget} retries"]
    for i, (fault, result, dec) in enumerate(
        zip(scenario.faults, scenario.launches, scenario.decisions)
    ):
        outcome = f"{dec.action}, exit code {dec.exit_code}: {dec.reason}" if dec else "-"
        evidence.append(f"launch {i} ({fault}): exit {result.returncode} -> {outcome}")
    expected = [REQUEUE] * budget + [STOP]
    problems = []
    if [dec.action for dec in decisions] != expected:
        problems.append(f"decisions {[dec.action for dec in decisions]} != {expected}")
    if decisions and decisions[-1].exit_code != exit_codes.RETRY_BUDGET_EXHAUSTED:
        problems.append(
            f"final exit code {decisions[-1].exit_code} != "
            f"{exit_codes.RETRY_BUDGET_EXHAUSTED} (RETRY_BUDGET_EXHAUSTED)"
        )
    return _judge("retry_budget", evidence, problems)


# ---------------------------------------------------------------- 11. old worker group gone


def check_old_world_exited(d: DrillData) -> CheckResult:
    launches = [(s.name, i, r) for s in d.scenarios.values() for i, r in enumerate(s.launches)]
    observed = [(n, i, r) for n, i, r in launches if r.leftover_pids is not None]
    if not observed:
        return _skipped("old_world_exited", "not observable with this launcher")
    evidence = [f"{len(observed)} launch(es) checked for leftover processes"]
    problems = [
        f"{n} launch {i}: processes {list(r.leftover_pids or ())} still run"
        for n, i, r in observed
        if r.leftover_pids
    ]
    return _judge("old_world_exited", evidence, problems)


# ---------------------------------------------------------------- all

Check = Callable[[DrillData], CheckResult]
# (id, scenario it needs, check); ids name failing items in the CLI's exit message.
ITEMS: tuple[tuple[str, str, Check], ...] = (
    ("restore_step", RECOVERY, check_restore_step),
    ("optimizer_lr", RECOVERY, check_optimizer_lr),
    ("data_position", RECOVERY, check_data_position),
    ("exact_resume", RECOVERY, check_exact_resume),
    ("ranks_same_step", RECOVERY, check_ranks),
    ("new_attempt_checkpoint", RECOVERY, check_new_attempt_checkpoint),
    ("final_result", RECOVERY, check_final_result),
    ("fallback_no_commit", NO_COMMIT, lambda d: check_fallback(d, NO_COMMIT)),
    ("fallback_missing_shard", NO_SHARD, lambda d: check_fallback(d, NO_SHARD)),
    ("retry_budget", BUDGET, check_retry_budget),
    ("old_world_exited", BASELINE, check_old_world_exited),
)
ACCEPTANCE_IDS = tuple(id_ for id_, _, _ in ITEMS[:7])


def run_checks(d: DrillData) -> list[CheckResult]:
    results = []
    for id_, needs, check in ITEMS:
        if needs != BASELINE and needs not in d.requested:
            results.append(_skipped(id_, f"scenario {needs!r} not requested"))
        else:
            results.append(check(d))
    return results
