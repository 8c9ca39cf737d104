"""The chaos soak's runs: one job under the fault-tolerant launcher, faults at random times.

Three launches of ``python -m launch local`` (ft_launcher):

1. a probe (a few steps, no checkpoints) times one step, which sizes the job to ``--minutes``
   of training (skipped with ``--steps``);
2. the clean run: the job as configured, no fault; its median step time converts times to
   steps;
3. the soak run: the same job with a fault schedule (:func:`plan_faults`): inter-fault times
   drawn from an exponential distribution with mean ``--mtbf`` seconds of training (or
   ``--mtbf-steps`` steps, for a count of faults that does not depend on the machine), the
   kinds dealt from shuffled decks so every kind comes up. Each fault is a ``train.fault``
   entry limited to one launcher round, so it hits
   once and the restarted group runs on.

Why a schedule in steps rather than signals from outside at wall-clock times: a kill inside a
save or in the publish window, a corrupted newest step and a NaN need the trainer's own
injection points; planned in steps, a soak is reproducible from its seed. The report says
where each fault landed in time.
"""

from __future__ import annotations

import json
import logging
import math
import random
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from drill.experiment import prepare_out
from drill.jobs import DrillError, _job_env
from drill.soak.outside import (
    OUTSIDE_KINDS,
    OutsideDriver,
    OutsideFault,
    OutsideRun,
    plan_outside,
)
from drill.soak.resources import around_soak, remote_url, usable_kinds
from pretrain.context.run_dir import RunDir, read_jsonl
from recipes import ConfigError, RunConfig, load_config

log = logging.getLogger(__name__)

# A killed rank (any time), one killed inside a save (shards written, no commit) and in the
# publish window (committed, not renamed), a hung rank, a killed async writer, a newest step
# that rots on disk, and a transient NaN (a silent data corruption, replayed in place).
KINDS = ("kill", "kill_save", "kill_publish", "hang", "kill_writer", "corrupt", "sdc")
AT_SAVE = frozenset({"kill_save", "kill_publish", "kill_writer", "corrupt"})
ON_RANK_0 = frozenset({"kill_publish"})  # rank 0 alone publishes (renames the step dir)
IN_PLACE = frozenset({"sdc"})  # answered by train.guard.policy=replay: no restart
PROBE_STEPS = 6
DEFAULT_RECIPE = "recipe=gpt_tiny"


@dataclass(frozen=True)
class PlannedFault:
    kind: str
    step: int
    rank: int
    round: int  # the launcher round (TORCHELASTIC_RESTART_COUNT) it is limited to
    at_s: float  # planned time, in seconds of training since the start

    def spec(self) -> str:
        return f"{self.kind}@{self.step}:{self.rank}/{self.round}"


@dataclass(frozen=True)
class SoakConfig:
    out: Path
    overrides: tuple[str, ...] = ()
    minutes: float = 5.0
    mtbf_s: float = 30.0
    mtbf_steps: float | None = None  # mean steps between faults instead (reproducible counts)
    # MTBF = this x (save + restart cost), both measured on the clean run (the bench's P6)
    mtbf_cost_multiple: float | None = None
    steps: int | None = None  # None: sized from the probe to ``minutes``
    nproc: int = 2
    seed: int | None = None
    kinds: tuple[str, ...] = KINDS
    launch_timeout_s: float = 3600.0
    outside: bool = False  # faults injected by the soak process (drill.soak.outside)
    kinds_given: bool = False  # --kinds named them: one this machine cannot inject is refused


@dataclass
class SoakRuns:
    """What the three launches left: run dirs, exit codes, wall times, the schedule."""

    out: Path
    steps: int
    step_s: float
    seed: int
    save_every: int
    faults: list[PlannedFault] = field(default_factory=list)
    exits: dict[str, int] = field(default_factory=dict)
    wall_s: dict[str, float] = field(default_factory=dict)
    overrides: list[str] = field(default_factory=list)
    mtbf_s: float | None = None  # derived from measured costs (mtbf_cost_multiple)
    # The MTBF the faults were planned at, in seconds of training (P6's planner is fed it)
    planned_mtbf_s: float | None = None
    outside: OutsideRun | None = None  # --outside: what the soak injected and confirmed

    def run_dir(self, name: str) -> Path:
        return self.out / "runs" / name / "soak"


@dataclass(frozen=True)
class JobShape:
    """What the schedule must fit: the job's steps, saves, ranks and hang-timeout learning."""

    steps: int
    step_s: float
    save_every: int
    nproc: int
    learn_after: int  # resiliency.ft.learn_after_steps: a hang before it waits the default

    def earliest(self, kind: str) -> int:
        """A NaN is replayed from a checkpoint, so one must exist before it; a rotten newest
        step falls back to the one before it, so that one must exist too; a hang is caught
        by learned timeouts (before them, by the untrained default of minutes)."""
        every = self.save_every
        return {"sdc": every + 1, "corrupt": 2 * every, "hang": self.learn_after + 2}.get(kind, 1)


def plan_faults(
    rng: random.Random, shape: JobShape, mtbf_s: float, kinds: tuple[str, ...] = KINDS
) -> list[PlannedFault]:
    """The schedule: exponential gaps (mean ``mtbf_s`` of training) in steps, each fault
    strictly after the one before (so each round reaches its fault), save-point kinds on the
    next save step, none on the last step (the job must finish to be compared)."""
    steps, step_s, save_every = shape.steps, shape.step_s, shape.save_every
    faults: list[PlannedFault] = []
    at_s, step, round_, deck = 0.0, 1, 0, []  # step 1 at the earliest: there must be a step 0
    while True:
        at_s += rng.expovariate(1.0 / mtbf_s)
        at = max(step + 1, math.ceil(at_s / step_s))
        deck = deck or rng.sample(list(kinds), len(kinds))
        kind = deck.pop()
        at = max(at, shape.earliest(kind))
        if kind in AT_SAVE:
            at = math.ceil(at / save_every) * save_every
        if at >= steps:
            return faults
        rank = rng.randrange(shape.nproc)
        rank = 0 if kind in ON_RANK_0 else rank  # drawn anyway: the same seed, the same plan
        faults.append(PlannedFault(kind, at, rank, round_, at_s))
        step = at
        round_ += kind not in IN_PLACE


def resolve(overrides: list[str]) -> RunConfig:
    try:
        return load_config(overrides)
    except ConfigError as exc:
        raise DrillError(f"bad recipe overrides: {exc}") from None


def soak_overrides(cfg: SoakConfig) -> list[str]:
    """The user's overrides plus what a soak needs: the fault-tolerant launcher, async saves
    (a writer to kill), every step kept (evidence), the replay guard (a transient NaN)."""
    user = list(cfg.overrides)
    if not any(o.startswith("recipe=") for o in user):
        user.insert(0, DEFAULT_RECIPE)
    forced = ["launch.backend=ft_launcher", "train.guard.policy=replay"]
    if "kill_writer" in cfg.kinds:
        forced.append("checkpoint.async_save=true")
    return [*user, *forced]


class SoakLauncher:
    """``python -m launch local`` with the job's output in a log file (never a pipe)."""

    def __init__(self, cfg: SoakConfig, logs: Path) -> None:
        self.cfg, self.logs = cfg, logs

    def run(self, name: str, overrides: list[str], max_restarts: int = 0) -> tuple[int, float]:
        return self.watch(name, overrides, max_restarts, lambda job, relaunch: None)

    def watch(
        self,
        name: str,
        overrides: list[str],
        max_restarts: int,
        beside: Callable[[subprocess.Popen, Callable[[], subprocess.Popen]], None],
        env: dict[str, str] | None = None,
    ) -> tuple[int, float]:
        """Launch, run ``beside(job, relaunch)`` while it runs (the outside faults), wait for
        the end of the last launch. ``relaunch()`` starts the same command again, its output
        appended to the same log (an operator's relaunch after a fault the launcher does not
        retry, e.g. a full disk), and returns it."""
        cmd = [
            sys.executable,
            "-m",
            "launch",
            "local",
            f"--nproc={self.cfg.nproc}",
            f"--max-restarts={max_restarts}",
            *overrides,
        ]
        self.logs.mkdir(parents=True, exist_ok=True)
        path = self.logs / f"{name}.log"
        started = time.time()
        log.info("soak: %s launch (%s)", name, path)
        jobs: list[subprocess.Popen] = []

        def launch(mode: str) -> subprocess.Popen:
            with path.open(mode) as out:
                jobs.append(
                    subprocess.Popen(
                        cmd, env=_job_env(env or {}), stdout=out, stderr=subprocess.STDOUT
                    )
                )
            return jobs[-1]

        launch("w")
        try:
            beside(jobs[0], lambda: launch("a"))
            code = jobs[-1].wait(
                timeout=max(self.cfg.launch_timeout_s - (time.time() - started), 1)
            )
        except subprocess.TimeoutExpired:
            jobs[-1].kill()
            jobs[-1].wait()
            code = 124
        except BaseException:  # the soak itself failed or was stopped: so is its job
            _stop(jobs[-1])
            raise
        wall = time.time() - started
        log.info("soak: %s exit %d in %.0f s (%d launch(es))", name, code, wall, len(jobs))
        return code, wall


def _stop(job: subprocess.Popen) -> None:
    """Stop a launch: SIGTERM (the launcher passes it on: the ranks save and leave), then
    SIGKILL if it has not ended within a minute."""
    if job.poll() is not None:
        return
    job.terminate()
    try:
        job.wait(timeout=60)
    except subprocess.TimeoutExpired:
        job.kill()
        job.wait()


def _mean_step_s(run_dir: Path) -> float:
    """The steady step time: the median of steps after the first (its warm-up excluded)."""
    records = read_jsonl(RunDir(run_dir).steps_metrics)
    times = sorted(r["step_time_s"] for r in records if r["step"] > 1 and "step_time_s" in r)
    if not times:
        raise DrillError(f"{run_dir} logged no step times")
    return times[len(times) // 2]


def clean_costs(run_dir: Path) -> tuple[float, float]:
    """(mean blocking save, start: process start -> first step done) of a finished run: what
    a save and, roughly, a restart cost it."""
    records = read_jsonl(RunDir(run_dir).checkpoint_metrics)
    # "staging": once per attempt (sizing the buffers), a start cost rather than a save's
    saves = [s["blocked_s"] for s in records if s.get("tier") != "staging"]
    record = json.loads(sorted(RunDir(run_dir).attempts_dir.glob("attempt-*.json"))[0].read_text())
    startup = record.get("startup") or {}
    start = startup.get("first_step_done_at", 0.0) - startup.get("process_start", 0.0)
    return (sum(saves) / len(saves) if saves else 0.0), max(start, 0.0)


def run_soak(cfg: SoakConfig) -> SoakRuns:
    out = prepare_out(cfg.out)
    seed = cfg.seed if cfg.seed is not None else random.SystemRandom().randrange(1, 1 << 30)
    launcher = SoakLauncher(cfg, out / "logs")
    base = soak_overrides(cfg)
    run = resolve(base)
    save_every = run.checkpoint.save_interval
    if not run.checkpoint.enabled or save_every < 1:
        raise DrillError("a soak needs checkpoints: checkpoint.enabled=true, save_interval >= 1")
    kinds = usable_kinds(cfg.kinds, cfg.kinds_given, run) if cfg.outside else cfg.kinds
    steps = cfg.steps
    if steps is None:  # sized to --minutes by a probe's step time
        steps = max(
            4 * save_every,
            math.ceil(cfg.minutes * 60 / _mean_step_s(_probe(launcher, base, run, out))),
        )
    runs = SoakRuns(out, steps, 0.0, seed, save_every)
    # A rotten newest step falls back to the one before it: at least two are kept.
    keep = max(run.checkpoint.keep_last, 2)
    runs.overrides = [*base, f"train.train_steps={steps}", f"checkpoint.keep_last={keep}"]
    # Every NaN may be replayed: the budget is the in-place faults' count, the largest
    # possible being one per step (the clean run's config must be the soak's).
    runs.overrides.append(f"train.guard.max_rollbacks={steps}")
    log.info("soak: seed %d, %d steps, a save every %d", seed, steps, save_every)
    _launch(launcher, runs, "clean", remote_url(run, "clean"), 0)
    if runs.exits["clean"] != 0:
        raise DrillError(
            f"the clean run failed (exit {runs.exits['clean']}); see {out / 'logs' / 'clean.log'}"
        )
    runs.step_s = _mean_step_s(runs.run_dir("clean"))
    learn_after = run.resiliency.ft.learn_after_steps
    if cfg.mtbf_cost_multiple is not None:
        runs.mtbf_s = cfg.mtbf_cost_multiple * sum(clean_costs(runs.run_dir("clean")))
        log.info(
            "soak: MTBF %.1f s (%g x the clean run's save + start)",
            runs.mtbf_s,
            cfg.mtbf_cost_multiple,
        )
    runs.planned_mtbf_s = runs.mtbf_s or (
        cfg.mtbf_steps * runs.step_s if cfg.mtbf_steps else cfg.mtbf_s
    )
    if cfg.outside:
        _soak_from_outside(launcher, runs, cfg, kinds, run)
        (out / "soak.json").write_text(json.dumps(_plan_record(runs), indent=1))
        return runs
    if cfg.mtbf_steps is not None:  # planned on a nominal 1 s step: reproducible in steps
        shape = JobShape(steps, 1.0, save_every, cfg.nproc, learn_after)
        runs.faults = plan_faults(random.Random(seed), shape, cfg.mtbf_steps, cfg.kinds)
    else:
        shape = JobShape(steps, runs.step_s, save_every, cfg.nproc, learn_after)
        runs.faults = plan_faults(random.Random(seed), shape, runs.mtbf_s or cfg.mtbf_s, cfg.kinds)
    restarts = sum(f.kind not in IN_PLACE for f in runs.faults)
    schedule = f'train.fault="{";".join(f.spec() for f in runs.faults)}"'
    extra = [*remote_url(run, "soak"), *([schedule] if runs.faults else [])]
    _launch(launcher, runs, "soak", extra, restarts + 1)
    (out / "soak.json").write_text(json.dumps(_plan_record(runs), indent=1))
    return runs


def _launch(
    launcher: SoakLauncher, runs: SoakRuns, name: str, extra: list[str], budget: int
) -> None:
    run_dir = runs.run_dir(name)
    overrides = [*runs.overrides, f"output_dir={run_dir.parent}", "run_id=soak", *extra]
    runs.exits[name], runs.wall_s[name] = launcher.run(name, overrides, budget)


# The share of the clean run's training time the planned faults may use up, gaps and recovery
# together: the rest is slack for a slower recovery than planned, so every planned fault lands.
PLANNED_SHARE = 0.75


def fit_plan(drawn: list[OutsideFault], train_s: float, recovery_s: float) -> list[OutsideFault]:
    """The first faults of ``drawn`` (arrivals of a Poisson process: exponential gaps) whose
    gaps, plus ``recovery_s`` of training each one costs again (the steps since the last save,
    and the step the soak waits for before the next gap), fit in PLANNED_SHARE of ``train_s``
    (an outage runs beside the faults after it: its length is not counted). At least one, so a
    soak always injects something."""
    plan, used = [], 0.0
    for fault in drawn:
        used += fault.gap_s + recovery_s
        if plan and used > PLANNED_SHARE * train_s:
            break
        plan.append(fault)
    return plan


def _soak_from_outside(
    launcher: SoakLauncher,
    runs: SoakRuns,
    cfg: SoakConfig,
    kinds: tuple[str, ...],
    run: RunConfig,
) -> None:
    """The soak run with faults the soak process injects (:mod:`drill.soak.outside`): those of
    a Poisson process at the MTBF that fit in the clean run's training time (:func:`fit_plan`);
    each must then be injected (one the job outlives fails the soak). ``kinds``: those this
    machine allows (:func:`usable_kinds`); ``run``: the resolved config."""
    mtbf = runs.mtbf_s or (cfg.mtbf_steps * runs.step_s if cfg.mtbf_steps else cfg.mtbf_s)
    kinds = tuple(k for k in kinds if k in OUTSIDE_KINDS)  # usable_kinds: never empty
    drawn = plan_outside(
        random.Random(runs.seed), math.ceil(3 * runs.steps * runs.step_s / mtbf) + 3, mtbf,
        cfg.nproc, kinds,
    )  # fmt: skip
    plan = fit_plan(drawn, runs.steps * runs.step_s, (runs.save_every + 1) * runs.step_s)
    log.info(
        "soak: %d fault(s) planned from seed %d: %s",
        len(plan),
        runs.seed,
        ", ".join(f"{f.kind}@+{f.gap_s:.1f}s rank {f.rank}" for f in plan),
    )
    count = len(plan)
    runs.outside = OutsideRun(runs.seed, plan)
    run_dir = runs.run_dir("soak")
    # A hang is caught by learned timeouts only after resiliency.ft.learn_after_steps.
    hang_after = run.resiliency.ft.learn_after_steps + 2
    with around_soak(kinds, run, run_dir, runs.run_dir("clean")) as around:
        driver = OutsideDriver(
            run_dir,
            launcher.logs / "soak.log",
            runs.outside,
            hang_after,
            cfg.launch_timeout_s,
            around.disk_root,
            around.proxy,
            around.remote_newest,
        )
        overrides = [
            *runs.overrides,
            *remote_url(run, "soak"),
            *around.overrides,
            f"output_dir={run_dir.parent}",
            "run_id=soak",
        ]
        runs.exits["soak"], runs.wall_s["soak"] = launcher.watch(
            "soak", overrides, count + 1, driver.drive, around.env
        )


def _probe(launcher: SoakLauncher, base: list[str], run: RunConfig, out: Path) -> Path:
    run_dir = out / "runs" / "probe" / "soak"
    overrides = [
        *base,
        f"train.train_steps={PROBE_STEPS}",
        "checkpoint.enabled=false",
        *remote_url(run, "probe"),
        f"output_dir={run_dir.parent}",
        "run_id=soak",
    ]
    code, _ = launcher.run("probe", overrides)
    if code != 0:
        raise DrillError(f"the probe run failed (exit {code}); see {out / 'logs' / 'probe.log'}")
    return run_dir


def _plan_record(runs: SoakRuns) -> dict:
    return {
        "seed": runs.seed,
        "steps": runs.steps,
        "step_s": runs.step_s,
        "save_every": runs.save_every,
        "faults": [asdict(f) | {"spec": f.spec()} for f in runs.faults],
        "exits": runs.exits,
        "wall_s": runs.wall_s,
        "mtbf_s": runs.mtbf_s,
        "overrides": runs.overrides,
        **({"outside": runs.outside.record()} if runs.outside else {}),
    }
