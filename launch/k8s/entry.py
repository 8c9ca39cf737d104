"""In-pod entrypoint for k8s jobs: run torchrun in-process, map exit codes for the operator.

``python -m launch.k8s.entry --launcher torchrun|ft_launcher --retries N --state-dir DIR -- ARGS``

Why it exists: the training-operator's ``restartPolicy: ExitCode`` recreates a pod whose
container exited 128-255 and fails the job on 1-127 (``IsRetryableExitCode: code >= 128``),
and ignores ``runPolicy.backoffLimit`` for ExitCode replicas. torchrun itself exits 1 whatever
its workers returned, so run bare it would make every failure, preemption included, permanent.
This wrapper runs the launcher in-process, takes the root-cause worker's exit code from its
ChildFailedError, maps it, and keeps a per-node retry budget on the shared volume
(``DIR/$MCORE_RECIPES_JOB_ID/node-$PET_NODE_RANK.json``):

  worker exit code                         container exit          operator    budget
  0                                        0                       succeeded   -
  DO_NOT_RETRY (2-11)                      same code               job fails   -
  REQUEUE (75), agent stopped by SIGTERM   128+75, 128+signal      pod retried not counted
  INFRASTRUCTURE (1), killed by a signal   128+1, 128+signal       pod retried counted
  INTERRUPTED (130), agent stopped by SIGINT  13 (INTERRUPTED_IN_POD)  job fails   -
  retry budget used up                     7 (RETRY_BUDGET_EXHAUSTED)  job fails
  any other code                           same code               job fails   (unknown: a
                                                                   blind retry could loop)

A wrapper killed before recording its outcome (SIGKILL, node loss) is counted at the next start.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from pathlib import Path
from types import FrameType

from launch.k8s.isolation import CONDITIONS_DIR, write_condition
from launch.standby.launch import Standby, standby_env
from launch.torchrun import LAUNCHERS, SIGNAL_BASE, Outcome, run_launcher
from pretrain.context import exit_codes
from pretrain.platform.logs import setup_launcher_logging
from recipes.load import load_config_file
from resiliency.monitor.fault_tolerance import write_launcher_config
from resiliency.monitor.health import describe, preflight
from resiliency.storage.layout import atomic_write_json

log = logging.getLogger(__name__)


def classify(outcome: Outcome) -> tuple[int, bool]:
    """(container exit code, whether it counts against the retry budget)."""
    code = outcome.code
    if code == exit_codes.OK:
        return code, False
    if code in (exit_codes.INTERRUPTED, -signal.SIGINT):  # the user's stop: never recreated
        return exit_codes.INTERRUPTED_IN_POD, False
    if code < 0:
        return SIGNAL_BASE - code, not outcome.planned
    if code == exit_codes.REQUEUE:
        return SIGNAL_BASE + code, False
    if code == exit_codes.INFRASTRUCTURE:
        return SIGNAL_BASE + code, True
    if code >= SIGNAL_BASE:
        return code, True
    return code, False  # DO_NOT_RETRY and unknown codes: 1-127, permanent


class RetryBudget:
    """Per-node count of unplanned restarts, persisted where every incarnation finds it."""

    def __init__(self, path: Path, limit: int) -> None:
        self.path, self.limit = path, limit

    def _read(self) -> dict[str, int | bool]:
        try:
            return json.loads(self.path.read_text())
        except FileNotFoundError:
            return {"retries": 0, "running": False}

    def _write(self, retries: int, running: bool) -> bool:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_json(self.path, {"retries": retries, "running": running})
        except OSError as exc:  # a full state volume: decide anyway, this count unrecorded
            log.warning("retry budget not recorded in %s: %s", self.path, exc)
        return retries <= self.limit

    def start(self) -> bool:
        """Record a start; False when the budget is already used up."""
        state = self._read()
        # Still "running": the previous incarnation died before it could record its outcome.
        retries = int(state["retries"]) + (1 if state["running"] else 0)
        return self._write(retries, True)

    def finish(self, counted: bool) -> bool:
        """Record the outcome; False when this failure used up the budget."""
        retries = int(self._read()["retries"]) + (1 if counted else 0)
        return self._write(retries, False)


class _Stopped(Exception):
    def __init__(self, sigval: int) -> None:
        super().__init__(f"received signal {sigval}")
        self.sigval = sigval


def _on_signal(signum: int, frame: FrameType | None) -> None:
    # As PID 1 a process ignores SIGTERM unless it installs a handler; torchrun replaces this
    # one with its own once its workers start.
    raise _Stopped(signum)


def budget_path(state_dir: Path) -> Path:
    job = os.environ.get("MCORE_RECIPES_JOB_ID", "unknown-job")
    return state_dir / job / f"node-{os.environ.get('PET_NODE_RANK', '0')}.json"


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m launch.k8s.entry", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--launcher", choices=sorted(LAUNCHERS), default="torchrun")
    parser.add_argument(
        "--retries",
        type=int,
        required=True,
        help="unplanned restarts allowed per node before the job fails",
    )
    parser.add_argument(
        "--state-dir",
        type=Path,
        required=True,
        help="directory on the shared volume for the retry counters",
    )
    parser.add_argument(
        "--standby",
        type=Path,
        default=None,
        metavar="RUN_DIR",
        help="start the pod's standby server for RUN_DIR first (launch.standby)",
    )
    parser.add_argument(
        "launcher_args", nargs=argparse.REMAINDER, help="-- then the launcher's arguments"
    )
    args = parser.parse_args(argv)
    if args.launcher_args[:1] == ["--"]:
        args.launcher_args = args.launcher_args[1:]
    return args


def with_ft_config(launcher_args: list[str], state_dir: Path) -> list[str]:
    """ft_launcher refuses to start without its section/timeout config: write it from the
    pinned run config (the ``--config`` after ``-m pretrain``) into the shared state dir, and
    pass the restart grace (resiliency.ft.workers_stop_timeout_s) from the same config."""
    if any(a.startswith("--ft-cfg-path") for a in launcher_args) or "--config" not in launcher_args:
        return launcher_args
    run = load_config_file(launcher_args[launcher_args.index("--config") + 1])
    path = write_launcher_config(run, state_dir)
    grace = f"--workers-stop-timeout={run.resiliency.ft.workers_stop_timeout_s:g}"
    return [f"--ft-cfg-path={path}", grace, *launcher_args]


def node_healthy(launcher_args: list[str], state_dir: Path) -> bool:
    """The node's health check before torchrun starts (every pod start, so after every
    restart); the reports of the job's pods go where rank 0 records them."""
    if "--config" not in launcher_args:
        return True
    run = load_config_file(launcher_args[launcher_args.index("--config") + 1])
    job = os.environ.get("MCORE_RECIPES_JOB_ID", "job")
    report = preflight(run, state_dir / job / "health")
    if report is None:
        return True
    (log.info if report.ok else log.error)("%s", describe(report))
    if not report.ok and (path := write_condition(report, state_dir / job / CONDITIONS_DIR)):
        log.error("the node's hardware condition, for the cluster's operators: %s", path)
    return report.ok


def main(argv: list[str]) -> int:
    setup_launcher_logging()
    args = _parse(argv)
    signal.signal(signal.SIGTERM, _on_signal)
    budget = RetryBudget(budget_path(args.state_dir), args.retries)
    if not budget.start():
        log.error("retry budget of %d restarts used up (%s)", args.retries, budget.path)
        return exit_codes.RETRY_BUDGET_EXHAUSTED
    if args.launcher == "ft_launcher":
        args.launcher_args = with_ft_config(args.launcher_args, args.state_dir)
    if not node_healthy(args.launcher_args, args.state_dir):
        budget.finish(counted=True)  # retried by the operator like any infrastructure failure
        return classify(Outcome(exit_codes.INFRASTRUCTURE, planned=False))[0]  # 128+1
    standby = None
    if args.standby is not None:
        os.environ.update(standby_env(args.standby))  # the workers find it by name
        standby = Standby(args.standby)
    try:
        outcome = run_launcher(args.launcher, args.launcher_args)
    except _Stopped as exc:
        outcome = Outcome(-exc.sigval, planned=True)
    finally:
        if standby is not None:
            standby.stop()
    code, counted = classify(outcome)
    if not budget.finish(counted) and code >= SIGNAL_BASE:
        log.error(
            "retry budget of %d restarts used up; not retrying (worker exit %d)",
            args.retries,
            outcome.code,
        )
        return exit_codes.RETRY_BUDGET_EXHAUSTED
    log.info("worker exit %d -> container exit %d", outcome.code, code)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
