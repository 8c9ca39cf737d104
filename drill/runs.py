"""The drill's training runs: baseline, kill-and-recover, broken newest step, retry budget.

Every relaunch is decided by :func:`launch.retry_policy.decide` from the attempt records, as
the Slurm batch script does; only the fault schedule changes between launches.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from drill.jobs import DrillError, Launcher, LaunchResult, LaunchSpec
from launch.retry_policy import STOP, Decision, decide, newest_attempt
from resiliency.storage.layout import COMMITTED_NAME, RunLayout

log = logging.getLogger(__name__)

BASELINE, RECOVERY, NO_COMMIT, NO_SHARD, BUDGET = (
    "baseline",
    "recovery",
    "no-commit",
    "no-shard",
    "budget",
)
SCENARIOS = (RECOVERY, NO_COMMIT, NO_SHARD, BUDGET)  # the baseline always runs
BROKEN = (NO_COMMIT, NO_SHARD)


@dataclass(frozen=True)
class DrillPlan:
    """Scaled-down step numbers of the minimal repeatable fault experiment."""

    steps: int = 16
    save_every: int = 4
    kills: tuple[int, ...] = (6, 10)  # "kill@N": SIGKILL before step N, one kill per launch
    budget_kill: int = 2
    max_retries: int = 2
    fault_rank: int = 1

    @staticmethod
    def default_kills(save_every: int) -> tuple[int, int]:
        """Halfway between saves: after the first save, and after the one the restart writes."""
        half = max(save_every // 2, 1)
        return save_every + half, 2 * save_every + half

    def last_commit_before(self, step: int) -> int | None:
        """The newest periodic save a kill before ``step`` leaves behind."""
        saved = (step - 1) // self.save_every * self.save_every
        return saved or None

    def validate(self) -> None:
        if self.save_every < 1 or self.steps <= self.save_every:
            raise DrillError(f"need 1 <= save_every < steps (got {self.save_every}, {self.steps})")
        if (
            not self.kills
            or list(self.kills) != sorted(set(self.kills))
            or not self.save_every < self.kills[0]
            or self.kills[-1] > self.steps
        ):
            raise DrillError(
                f"kills {list(self.kills)} must increase, start after the first "
                f"save (step {self.save_every}) and end by step {self.steps}"
            )
        commits = [self.last_commit_before(k) for k in self.kills]
        if len(set(commits)) != len(commits):
            raise DrillError(
                f"kills {list(self.kills)}: put a save between consecutive kills, "
                f"so each restart restores a checkpoint the previous one wrote"
            )
        if len(self.kills) > self.max_retries:
            raise DrillError(
                f"{len(self.kills)} kills need at least as many retries "
                f"(--max-retries {self.max_retries})"
            )

    def fault(self, step: int) -> str:
        return f"kill@{step}:{self.fault_rank}"


@dataclass
class Scenario:
    name: str
    run_dir: Path
    expected_restores: list[int | None]  # per launch: the step it must restore (None: fresh)
    damage: str | None = None  # what was broken in the copied run before launching
    launches: list[LaunchResult] = field(default_factory=list)
    faults: list[str] = field(default_factory=list)
    decisions: list[Decision | None] = field(default_factory=list)
    attempts: list[int | None] = field(default_factory=list)  # attempt id each launch recorded

    def add(
        self, result: LaunchResult, fault: str, decision: Decision | None, attempt: int | None
    ) -> None:
        self.launches.append(result)
        self.faults.append(fault)
        self.decisions.append(decision)
        self.attempts.append(attempt)

    @property
    def finished(self) -> bool:
        last = self.decisions[-1] if self.decisions else None
        return last is not None and last.action == STOP and last.exit_code == 0


@dataclass(frozen=True)
class ResumeExtras:
    """Extra settings for launches that find a checkpoint to restore (to break exactness)."""

    env: dict[str, str] = field(default_factory=dict)
    overrides: tuple[str, ...] = ()


@dataclass
class Runner:
    launcher: Launcher
    base_overrides: list[str]
    runs_dir: Path
    logs_dir: Path
    run_id: str
    plan: DrillPlan
    resume: ResumeExtras = field(default_factory=ResumeExtras)

    def run_dir(self, scenario: str) -> Path:
        return self.runs_dir / scenario / self.run_id

    def overrides(self, run_dir: Path, extra: Sequence[str]) -> list[str]:
        return [
            *self.base_overrides,
            f"output_dir={run_dir.parent}",
            f"run_id={self.run_id}",
            *extra,
        ]

    def checkpointing(self) -> list[str]:
        keep = self.plan.steps // self.plan.save_every + 2  # keep every step as evidence
        return [f"checkpoint.save_interval={self.plan.save_every}", f"checkpoint.keep_last={keep}"]

    def baseline(self) -> Scenario:
        scenario = Scenario(BASELINE, self.run_dir(BASELINE), [None])
        spec = LaunchSpec(
            scenario.run_dir,
            self.overrides(scenario.run_dir, ["checkpoint.enabled=false"]),
            self.logs_dir / f"{BASELINE}-00.log",
        )
        result = self.launcher.launch(spec)
        scenario.add(result, "", None, None)
        log.info("baseline: exit %d in %.0f s", result.returncode, result.end - result.start)
        return scenario

    def recovery(self) -> Scenario:
        plan = self.plan
        expected = [None, *(plan.last_commit_before(k) for k in plan.kills)]
        scenario = Scenario(RECOVERY, self.run_dir(RECOVERY), expected)
        self.relaunch(scenario, [plan.fault(k) for k in plan.kills])
        return scenario

    def broken(self, name: str, source: Scenario) -> Scenario:
        """Copy the finished recovery run, break its newest step, restart it once."""
        previous = self.plan.last_commit_before(self.plan.steps)
        scenario = Scenario(name, self.run_dir(name), [previous] * (self.plan.max_retries + 1))
        shutil.copytree(source.run_dir, scenario.run_dir, symlinks=True)
        scenario.damage = break_newest_step(RunLayout.from_run_dir(scenario.run_dir), name)
        self.relaunch(scenario, [])
        return scenario

    def budget(self) -> Scenario:
        plan = self.plan
        commit = plan.last_commit_before(plan.budget_kill)
        scenario = Scenario(BUDGET, self.run_dir(BUDGET), [None] + [commit] * plan.max_retries)
        self.relaunch(scenario, [plan.fault(plan.budget_kill)] * (plan.max_retries + 1))
        return scenario

    def relaunch(self, scenario: Scenario, faults: list[str]) -> None:
        """Launch until the retry policy says stop (finished, deterministic, or out of budget)."""
        for restart in range(self.plan.max_retries + 1):
            fault = faults[restart] if restart < len(faults) else ""
            after = newest_attempt(scenario.run_dir)
            result = self.launcher.launch(self._spec(scenario, restart, fault))
            decision = decide(scenario.run_dir, restart, self.plan.max_retries, after)
            attempt = newest_attempt(scenario.run_dir)
            scenario.add(result, fault, decision, attempt if attempt > after else None)
            log.info(
                "%s: launch %d (%s) exit %d in %.0f s -> %s",
                scenario.name,
                restart,
                fault or "no fault",
                result.returncode,
                result.end - result.start,
                decision.line(),
            )
            if decision.action == STOP:
                return

    def _spec(self, scenario: Scenario, restart: int, fault: str) -> LaunchSpec:
        resumed = bool(RunLayout.from_run_dir(scenario.run_dir).published_steps())
        extra = [
            *self.checkpointing(),
            *([f"train.fault={fault}"] if fault else []),
            *(self.resume.overrides if resumed else ()),
        ]
        return LaunchSpec(
            scenario.run_dir,
            self.overrides(scenario.run_dir, extra),
            self.logs_dir / f"{scenario.name}-{restart:02d}.log",
            dict(self.resume.env) if resumed else {},
        )


def break_newest_step(layout: RunLayout, how: str) -> str:
    """Damage the newest published step the way a crashed or partial upload would."""
    steps = layout.published_steps()
    if not steps:
        raise DrillError(f"{layout.run_dir} has no published step to break")
    step_dir = layout.step_dir(steps[-1])
    if how == NO_COMMIT:
        (step_dir / COMMITTED_NAME).unlink()
        return f"removed {step_dir.name}/{COMMITTED_NAME}"
    shard = sorted((step_dir / "model").glob("*.distcp"))[0]
    shard.unlink()
    return f"removed shard {step_dir.name}/model/{shard.name}"
