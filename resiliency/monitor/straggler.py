"""Straggler reports from nvidia-resiliency-ext's ``straggler.Detector``.

Each training step after ``warmup_steps`` is a detection section ("step"); every
``report_interval`` steps all ranks generate a report (a collective) and rank 0 names the ranks
whose relative score (fastest rank's median section time / this rank's) is below
``relative_threshold``, with their individual scores (vs. the rank's own best median). On a GPU
the CUDA-kernel scores count too; on CPU sections are timed in CPU time (see
:func:`pretrain.platform.cpu_shim.nvrx_straggler_on_cpu`). A rank only slower than its own past
(the whole job slowed down: a noisy machine) is logged, not named. Reports go to the log and to
``<run_dir>/metrics/straggler.jsonl``; with ``stop_if_detected`` the run saves and exits
STRAGGLER.
"""

from __future__ import annotations

import json
import logging
import math
import socket
import time
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from pretrain.context import exit_codes
from pretrain.context.run_dir import RunDir
from pretrain.platform.compat import nvrx_straggler
from pretrain.platform.cpu_shim import nvrx_straggler_on_cpu
from pretrain.train.hooks import StepResult, TrainHook

if TYPE_CHECKING:
    from pretrain.platform.distributed import DistEnv
    from pretrain.train.view import TrainerView
    from recipes.config.resiliency import StragglerConfig

log = logging.getLogger(__name__)
SECTION = "step"
REPORTS_FILE = "straggler.jsonl"


@dataclass
class StragglerReport:
    step: int
    time: float
    relative: dict[int, float] = field(default_factory=dict)  # rank -> score (1 = fastest)
    individual: dict[int, float] = field(default_factory=dict)  # rank -> score vs own best
    gpu_relative: dict[int, float] = field(default_factory=dict)
    stragglers: list[int] = field(default_factory=list)
    slower_than_before: list[int] = field(default_factory=list)


def summarize(report: Any, step: int, cfg: "StragglerConfig") -> StragglerReport:
    """Rank-0 view of an nvrx ``Report``: scores per rank and who is below the thresholds."""

    def finite(scores: dict[int, float]) -> dict[int, float]:
        return {int(r): round(float(s), 4) for r, s in scores.items() if math.isfinite(s)}

    out = StragglerReport(
        step,
        time.time(),
        finite(report.section_relative_perf_scores.get(SECTION, {})),
        finite(report.section_individual_perf_scores.get(SECTION, {})),
        finite(report.gpu_relative_perf_scores),
    )
    slow = {r for r, s in out.relative.items() if s < cfg.relative_threshold}
    slow |= {r for r, s in out.gpu_relative.items() if s < cfg.relative_threshold}
    out.stragglers = sorted(slow)
    out.slower_than_before = sorted(
        r for r, s in out.individual.items() if s < cfg.individual_threshold and r not in slow
    )
    return out


class StragglerHook(TrainHook):
    def __init__(self, cfg: "StragglerConfig", env: "DistEnv", run_dir: Path) -> None:
        self.cfg, self.env = cfg, env
        self.path = RunDir(run_dir).metrics_dir / REPORTS_FILE
        self.section: AbstractContextManager | None = None
        self.timed_steps = 0
        self.last: StragglerReport | None = None  # rank 0: read by the metrics hook
        self.detector: Any = None
        self.first_step = 1

    def on_start(self, trainer: "TrainerView") -> None:
        nvrx_straggler_on_cpu(self.env.device)

        self.detector = nvrx_straggler().Detector
        # report_time_interval is for generate_report_if_interval_elapsed, which is not used:
        # reports come every report_interval steps, the same step on every rank.
        self.detector.initialize(
            scores_to_compute="all",
            gather_on_rank0=True,
            profiling_interval=1,
            report_time_interval=float("inf"),
            node_name=socket.gethostname(),
        )
        self.first_step = trainer.state.step + 1

    def before_step(self, trainer: "TrainerView") -> None:
        if trainer.state.step + 1 >= self.first_step + self.cfg.warmup_steps:
            self.section = self.detector.detection_section(
                SECTION, profile_cuda=self.env.device == "cuda"
            )
            self.section.__enter__()

    def after_step(self, trainer: "TrainerView", result: StepResult) -> None:
        if self.section is not None:
            self.section.__exit__(None, None, None)
            self.section = None
            self.timed_steps += 1
        if self.timed_steps and result.step % self.cfg.report_interval == 0:
            self._report(trainer, result.step)

    def _report(self, trainer: "TrainerView", step: int) -> None:
        report = self.detector.generate_report()  # collective
        found = 0
        if self.env.rank == 0:
            self.last = summarize(report, step, self.cfg)
            found = len(self.last.stragglers)
            self._publish(self.last)
        if self.cfg.stop_if_detected and self._any_rank(found):
            log.error("straggler detected: saving and exiting %d", exit_codes.STRAGGLER)
            trainer.request_stop(exit_codes.STRAGGLER, "straggler detected")

    def _any_rank(self, found: int) -> bool:
        flag = torch.tensor([found], device=self.env.torch_device)
        dist.broadcast(flag, src=0)
        return bool(flag.item())

    def _publish(self, report: StragglerReport) -> None:
        if report.stragglers:
            log.warning(
                "straggler report at step %d: slow rank(s) %s; relative scores %s, "
                "individual scores %s",
                report.step,
                report.stragglers,
                {r: report.relative.get(r) for r in report.stragglers},
                {r: report.individual.get(r) for r in report.stragglers},
            )
        else:
            log.info(
                "straggler report at step %d: no straggler (relative scores %s)",
                report.step,
                report.relative,
            )
        if report.slower_than_before:
            log.info(
                "straggler report: rank(s) %s slower than their own best (individual "
                "scores %s), not slower than their peers",
                report.slower_than_before,
                {r: report.individual[r] for r in report.slower_than_before},
            )
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as stream:
            stream.write(json.dumps(asdict(report)) + "\n")

    def close(self) -> None:
        if self.detector is not None and self.detector.initialized:
            self.detector.shutdown()
