"""The minimal repeatable fault experiment, end to end, with an acceptance report.

Runs a no-fault baseline; the same run checkpointing every k steps and SIGKILLed on one rank
(twice, each relaunch restoring the newest commit, the second from a checkpoint the first
restart wrote); restarts of copies whose newest step lost its COMMITTED marker or a shard;
and consecutive kills until the retry budget stops the job. Then it judges the evidence
(:mod:`drill.acceptance`) and writes ``report.md`` and ``loss.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from drill.acceptance import FAIL, PASS, SKIP, CheckResult, DrillData, run_checks
from drill.jobs import DrillError, make_launcher
from drill.report import PlotData, plot_data, write_report
from drill.run_records import read_records, read_run, restore_events
from drill.runs import (
    BASELINE,
    BROKEN,
    BUDGET,
    RECOVERY,
    SCENARIOS,
    DrillPlan,
    ResumeExtras,
    Runner,
    Scenario,
)
from recipes import ConfigError, RunConfig, load_config
from recipes.validate import resolve_run_id
from resiliency.cli.base import EXIT_BAD, EXIT_OK, EXIT_USAGE

log = logging.getLogger(__name__)
MARKER = ".mcore-recipes-drill"  # only a dir holding this is ever cleared by a new drill
DEFAULT_RECIPE = "recipe=gpt_tiny"


@dataclass(frozen=True)
class DrillConfig:
    out: Path
    overrides: tuple[str, ...] = ()
    launcher: str = "local"
    plan: DrillPlan = field(default_factory=DrillPlan)
    scenarios: tuple[str, ...] = SCENARIOS
    device: str = "cpu"
    nproc: int | None = None  # None: the recipe's launch.nproc_per_node
    window: int = 8
    tolerance: float = 0.0  # relative; 0 = bit-exact, what CPU runs must achieve
    final_tolerance: float = 1e-3
    resume: ResumeExtras = field(default_factory=ResumeExtras)
    launch_timeout_s: float = 900.0


@dataclass
class DrillResult:
    checks: list[CheckResult]
    plot: PlotData
    report: Path
    data: DrillData

    @property
    def failed(self) -> list[str]:
        return [c.id for c in self.checks if c.status == FAIL]

    @property
    def exit_code(self) -> int:
        return EXIT_BAD if self.failed else EXIT_OK


def prepare_out(out: Path) -> Path:
    """An empty dir, or a previous drill's output (cleared); never anything else."""
    out = out.absolute()
    if out.exists() and any(out.iterdir()):
        if not (out / MARKER).exists():
            raise DrillError(
                f"--out {out} is not empty and holds no earlier drill; choose a new directory"
            )
        for child in out.iterdir():
            if child.name != MARKER:
                shutil.rmtree(child) if child.is_dir() else child.unlink()
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).touch()
    return out


def base_overrides(cfg: DrillConfig) -> list[str]:
    overrides = list(cfg.overrides)
    if not any(o.startswith("recipe=") for o in overrides):
        overrides.insert(0, DEFAULT_RECIPE)
    return [*overrides, f"train.train_steps={cfg.plan.steps}", f"train.device={cfg.device}"]


def requested_scenarios(names: Sequence[str]) -> tuple[str, ...]:
    unknown = sorted(set(names) - set(SCENARIOS))
    if unknown:
        raise DrillError(f"unknown scenario(s) {unknown}; choose from {list(SCENARIOS)}")
    wanted = set(names) | ({RECOVERY} if set(names) & set(BROKEN) else set())
    return tuple(s for s in SCENARIOS if s in wanted)  # broken copies need the recovered run


def run_scenarios(runner: Runner, requested: tuple[str, ...]) -> dict[str, Scenario]:
    scenarios = {BASELINE: runner.baseline()}
    _check_baseline(scenarios[BASELINE], runner.plan.steps)
    if RECOVERY in requested:
        scenarios[RECOVERY] = runner.recovery()
    for name in BROKEN:
        if name in requested and scenarios[RECOVERY].finished:
            scenarios[name] = runner.broken(name, scenarios[RECOVERY])
    if BUDGET in requested:
        scenarios[BUDGET] = runner.budget()
    return scenarios


def _check_baseline(baseline: Scenario, steps: int) -> None:
    # Judged by its metrics: under Slurm the job's exit code is the retry policy's verdict,
    # which has no attempt record to read when checkpointing is off.
    logged = {r.step for r in read_records(baseline.run_dir)}
    if not set(range(1, steps + 1)) <= logged:
        launch = baseline.launches[0]
        raise DrillError(
            f"the baseline run logged {len(logged)} of {steps} steps (exit "
            f"{launch.returncode}); see {launch.spec.log_path}"
        )


def _resolve(overrides: list[str]) -> tuple[RunConfig, dict]:
    # torch: the drill itself never loads it otherwise
    from pretrain.data.dataset import dataset_fingerprint

    try:
        # Every scenario has a run dir of its own: one fixed name for them all.
        run = resolve_run_id(load_config(overrides), "drill", world_size=1)
    except ConfigError as exc:
        raise DrillError(f"bad recipe overrides: {exc}") from None
    return run, dataset_fingerprint(run.data)


def run_drill(cfg: DrillConfig) -> DrillResult:
    cfg.plan.validate()
    requested = requested_scenarios(cfg.scenarios)
    overrides = base_overrides(cfg)
    run, fingerprint = _resolve(overrides)
    nproc = cfg.nproc or run.launch.nproc_per_node
    plan = dataclasses.replace(cfg.plan, fault_rank=min(cfg.plan.fault_rank, nproc - 1))
    launcher = make_launcher(cfg.launcher, nproc, Path.cwd(), cfg.launch_timeout_s)
    out = prepare_out(cfg.out)
    runner = Runner(launcher, overrides, out / "runs", out / "logs", run.run_id, plan, cfg.resume)
    scenarios = run_scenarios(runner, requested)
    data = collect(cfg, plan, nproc, run, fingerprint, requested, scenarios)
    checks = run_checks(data)
    plot = plot_data(data)
    report = write_report(out, data, checks, plot, overrides)
    return DrillResult(checks, plot, report, data)


def collect(
    cfg: DrillConfig,
    plan: DrillPlan,
    nproc: int,
    run: RunConfig,
    fingerprint: dict,
    requested: tuple[str, ...],
    scenarios: dict[str, Scenario],
) -> DrillData:
    runs = {name: read_run(s.run_dir) for name, s in scenarios.items()}
    events = [
        ev
        for name, s in scenarios.items()
        if name not in (BASELINE, BUDGET)
        for ev in restore_events(s, runs[name])
    ]
    return DrillData(
        plan,
        cfg.launcher,
        nproc,
        run.train.global_batch_size,
        run.model.seq_length,
        fingerprint,
        cfg.window,
        cfg.tolerance,
        cfg.final_tolerance,
        requested,
        scenarios,
        runs,
        events,
    )


# ---------------------------------------------------------------- CLI


def _int_list(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def _name_list(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def _env_pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def add_args(p: argparse.ArgumentParser) -> None:
    d = DrillPlan()
    p.add_argument(
        "overrides",
        nargs="*",
        help=f"recipe overrides (default {DEFAULT_RECIPE} on its stdlib corpus); the "
        "drill sets output_dir, train.train_steps, train.fault and "
        "checkpoint.save_interval/keep_last itself",
    )
    p.add_argument(
        "--launcher",
        choices=("local", "slurm"),
        default="local",
        help="local: torchrun here; slurm: python -m launch slurm (needs a cluster)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="output dir (default runs/drill-<time>); report.md and loss.png",
    )
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--save-every", type=int, default=d.save_every)
    p.add_argument(
        "--kills",
        type=_int_list,
        default=None,
        help="SIGKILL a rank before these steps, one kill per launch (default: "
        "halfway between the first saves, e.g. 6,10 for --save-every 4)",
    )
    p.add_argument("--max-retries", type=int, default=d.max_retries)
    p.add_argument(
        "--scenarios",
        type=_name_list,
        default=SCENARIOS,
        help=f"comma-separated subset of {','.join(SCENARIOS)}",
    )
    p.add_argument("--device", choices=("cpu", "cuda", "auto"), default="cpu")
    p.add_argument("--nproc", type=int, default=None, help="ranks (default: the recipe's)")
    p.add_argument("--window", type=int, default=8, help="steps compared after each restore")
    p.add_argument(
        "--tolerance",
        type=float,
        default=0.0,
        help="relative tolerance in the window (default 0: bit-exact, as on CPU)",
    )
    p.add_argument("--final-tolerance", type=float, default=1e-3)
    p.add_argument(
        "--resume-env",
        type=_env_pair,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="environment for launches that restore (a drill "
        "of the drill: e.g. MCORE_RECIPES_COMPAT_SKIP=I)",
    )
    p.add_argument(
        "--resume-override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="recipe override for launches that restore",
    )
    p.add_argument("--launch-timeout", type=float, default=900.0, help="seconds per launch")


def config_from_args(args: argparse.Namespace) -> DrillConfig:
    kills = args.kills or DrillPlan.default_kills(args.save_every)
    plan = DrillPlan(
        steps=args.steps, save_every=args.save_every, kills=kills, max_retries=args.max_retries
    )
    out = args.out or Path("runs") / time.strftime("drill-%Y%m%d-%H%M%S")
    return DrillConfig(
        out=out,
        overrides=tuple(args.overrides),
        launcher=args.launcher,
        plan=plan,
        scenarios=args.scenarios,
        device=args.device,
        nproc=args.nproc,
        window=args.window,
        tolerance=args.tolerance,
        final_tolerance=args.final_tolerance,
        resume=ResumeExtras(dict(args.resume_env), tuple(args.resume_override)),
        launch_timeout_s=args.launch_timeout,
    )


def run_from_args(args: argparse.Namespace) -> int:
    try:
        result = run_drill(config_from_args(args))
    except DrillError as exc:
        print(f"error: {exc}")
        return EXIT_USAGE
    print(f"report: {result.report}")
    print(verdict_line(result))
    return result.exit_code


def verdict_line(result: DrillResult) -> str:
    """The CLI's last line: which checks failed, and how many of each status."""
    counts = ", ".join(
        f"{sum(c.status == s for c in result.checks)} {s}" for s in (PASS, FAIL, SKIP)
    )
    if result.failed:
        return f"drill FAILED: {', '.join(result.failed)} ({counts})"
    return f"drill passed ({counts})"
