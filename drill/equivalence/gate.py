"""The resume-equivalence gate: an uninterrupted reference, the same run killed and resumed in
fresh processes, and their whole state compared byte for byte at the restored step and after
the first resumed step (resiliency/checkpoint/equivalence). With controls, the same resume
broken on purpose must be caught, each break by name.

One job gives both sides of the comparison: the reference trains to step K (saving it) and K+1,
dumping its state before steps K+1 and K+2, and is SIGKILLed before step K+2; a relaunch of the
same run restores step K and dumps at the same two moments.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from drill.equivalence.controls import CONTROLS, Control
from drill.jobs import DrillError, LaunchResult, LaunchSpec, LocalLauncher
from recipes import ConfigError, load_config
from resiliency.checkpoint.equivalence.compare import Verdict, compare_runs
from resiliency.storage.layout import RunLayout

log = logging.getLogger(__name__)
RUN_ID = "equivalence"
# Keys the gate sets itself: the user's overrides must leave them to it.
OWNED = (
    "output_dir",
    "run_id",
    "train.train_steps",
    "train.fault",
    "checkpoint.save_interval",
    "checkpoint.dump_state_at",
    "checkpoint.dump_state_dir",
    "checkpoint.enabled",
    "checkpoint.resume",
    "checkpoint.async_save",
)


@dataclass(frozen=True)
class GateConfig:
    out: Path
    overrides: tuple[str, ...]
    nproc: int = 2
    resume_nproc: int | None = None  # None: nproc (a DP change otherwise)
    step: int = 2  # K: the step saved and restored
    controls: bool = False
    rtol: float = 1e-5  # across a DP change, after the first resumed step
    timeout_s: float = 900.0
    cwd: Path = Path.cwd()

    def __post_init__(self) -> None:
        owned = sorted({o.split("=", 1)[0].lstrip("+~") for o in self.overrides} & set(OWNED))
        if owned:
            raise DrillError(
                f"the gate sets {', '.join(owned)} itself: drop them from the overrides"
            )
        if self.step < 1:
            raise DrillError(f"--step {self.step}: the restored step must be >= 1")
        if self.nproc < 1 or (self.resume_nproc is not None and self.resume_nproc < 1):
            raise DrillError("--nproc and --resume-nproc must be >= 1")

    @property
    def resumed_world(self) -> int:
        return self.resume_nproc or self.nproc


@dataclass
class GateResult:
    verdict: Verdict
    controls: dict[str, str] = field(default_factory=dict)  # control -> what caught it ('' not)
    skipped_controls: dict[str, str] = field(default_factory=dict)  # control -> why

    @property
    def passed(self) -> bool:
        return self.verdict.equivalent and all(self.controls.values())


def _base(cfg: GateConfig, runs: Path, dumps: Path) -> list[str]:
    k = cfg.step
    return [
        *cfg.overrides,
        f"output_dir={runs}",
        f"run_id={RUN_ID}",
        f"train.train_steps={k + 2}",
        f"checkpoint.save_interval={k}",
        "checkpoint.enabled=true",
        "checkpoint.resume=true",
        # Step K must be published before the kill after K+1: an async save publishes it at a
        # later step boundary. (The restore reads the same bytes either way.)
        "checkpoint.async_save=false",
        f"checkpoint.dump_state_at=[{k},{k + 1}]",
        f"checkpoint.dump_state_dir={dumps}",
    ]


def _launch(cfg: GateConfig, nproc: int, name: str, runs: Path, extra: list[str]) -> LaunchResult:
    dumps = cfg.out / "dumps" / name
    spec = LaunchSpec(runs / RUN_ID, [*_base(cfg, runs, dumps), *extra], cfg.out / f"{name}.log")
    log.info("equivalence: %s run (%d ranks), log %s", name, nproc, spec.log_path)
    return LocalLauncher(nproc, cfg.cwd, cfg.timeout_s).launch(spec)


def _fault(entries: list[str]) -> str:
    return f'train.fault="{";".join(entries)}"'


def run_gate(cfg: GateConfig) -> GateResult:
    if cfg.out.exists() and any(cfg.out.iterdir()):
        raise DrillError(f"--out {cfg.out} is not empty: give a new directory")
    k, runs = cfg.step, cfg.out / "runs"
    try:  # a typo is one line before any rank starts
        load_config(_base(cfg, runs, cfg.out / "dumps" / "reference"))
    except ConfigError as exc:
        raise DrillError(f"bad recipe overrides: {exc}") from None
    cfg.out.mkdir(parents=True, exist_ok=True)
    reference = _launch(cfg, cfg.nproc, "reference", runs, [_fault([f"kill@{k + 2}"])])
    published = RunLayout(runs, RUN_ID).published_steps()
    if reference.returncode == 0 or published != [k]:
        raise DrillError(
            f"the reference run should die before step {k + 2} with step {k} published; it "
            f"exited {reference.returncode} with {published or 'no step'} published "
            f"(log: {reference.spec.log_path})"
        )
    chosen, skipped = _controls(cfg)
    if chosen:
        shutil.copytree(runs, cfg.out / "runs-control")
        faults = [c.fault(k, cfg.resumed_world) for c in chosen] + [f"kill@{k + 2}"]
        _launch(cfg, cfg.resumed_world, "control", cfg.out / "runs-control", [_fault(faults)])
    resumed = _launch(cfg, cfg.resumed_world, "resumed", runs, [])
    if resumed.returncode != 0:
        raise DrillError(
            f"the resumed run exited {resumed.returncode} (log: {resumed.spec.log_path})"
        )
    dumps = cfg.out / "dumps"
    result = GateResult(compare_runs(dumps / "reference", dumps / "resumed", cfg.rtol))
    result.skipped_controls = skipped
    if chosen:
        broken = compare_runs(dumps / "reference", dumps / "control", cfg.rtol)
        exact = broken.mode == "same layout"
        for control in chosen:
            hit = control.caught(broken.differences, k, cfg.resumed_world, exact)
            result.controls[control.name] = hit
    return result


def _controls(cfg: GateConfig) -> tuple[list[Control], dict[str, str]]:
    if not cfg.controls:
        return [], {}
    if cfg.resumed_world == cfg.nproc:
        return list(CONTROLS), {}
    why = "a restore on another data-parallel size reseeds the RNG streams"
    return [c for c in CONTROLS if not c.rng], {c.name: why for c in CONTROLS if c.rng}
