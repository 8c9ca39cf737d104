"""Requeue or stop? Decided from the newest attempt record the trainer wrote, not exit codes.

The Slurm batch script calls this after its ``srun`` step ends. Launcher exit codes carry no
information (torchrun exits 1 with ChildFailedError whatever its workers returned), so the
decision reads ``<run_dir>/attempts/attempt-NN.json``, where the trainer's rank 0 records
``status`` and ``exit_code`` at exit. A record still saying starting/running means the process
was killed (node loss, OOM killer, time limit): an infrastructure failure, unless the launcher
logged a worker exit with a documented "do not retry" code and no worker killed by a signal
(the ranks exited 10 on a full disk that also kept them from finishing the record): that code
stops the job.

``python -m launch.retry_policy RUN_DIR --restart-count N --max-requeues M [--after-attempt K]``
prints ``requeue|stop <exit code> <reason>`` and exits with the code the batch script should
exit with (0 for requeue: the script then runs ``scontrol requeue``).
``python -m launch.retry_policy RUN_DIR --newest-attempt`` prints the newest attempt id (0 if
none), which the script records before ``srun`` so older records are never mistaken for
this run's outcome.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launch.requeues import append_ledger, excluded_so_far, failures_used, plan_exclusion
from launch.slurm.postmortem import finalize_job, launcher_events
from pretrain.context import exit_codes
from resiliency.monitor.health import unhealthy_nodes
from resiliency.monitor.postmortem import LauncherEvents, read_record
from resiliency.storage.attempts import recorded_attempts
from resiliency.storage.layout import RunLayout

REQUEUE, STOP = "requeue", "stop"
PLANNED, FAILURE = "planned", "failure"
KILLED_STATUSES = ("starting", "running")
RETRYABLE_CODES = (exit_codes.INFRASTRUCTURE, exit_codes.REQUEUE)


@dataclass(frozen=True)
class Decision:
    action: str  # "requeue" | "stop"
    exit_code: int  # what the batch script exits with (0 after a requeue)
    reason: str
    kind: str = ""  # a requeue's: "planned" (time limit, preemption) | "failure" (budgeted)

    def line(self) -> str:
        return f"{self.action} {self.exit_code} {self.reason}"


@dataclass(frozen=True)
class Outcome:
    """What the newest attempt of this run says about how it ended."""

    attempt: int | None
    status: str | None
    exit_code: int | None
    detail: str


def newest_attempt(run_dir: Path) -> int:
    """Id of the newest attempt record in ``run_dir`` (0 if there is none)."""
    return max(recorded_attempts(RunLayout.from_run_dir(run_dir)), default=0)


def read_outcome(run_dir: Path, after_attempt: int = 0) -> Outcome:
    """The newest attempt record with an id above ``after_attempt``, summarised."""
    layout = RunLayout.from_run_dir(run_dir)
    attempts = [a for a in recorded_attempts(layout) if a > after_attempt]
    if not attempts:
        return Outcome(
            None,
            None,
            None,
            "no attempt record was written (the trainer never "
            "started, or died before claiming an attempt)",
        )
    attempt = attempts[-1]
    path = layout.attempt_path(attempt)
    try:
        record: dict[str, Any] = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        return Outcome(attempt, None, None, f"{path.name} is unreadable ({exc})")
    code = record.get("exit_code")
    detail = f"{path.name}: status={record.get('status')} exit_code={code}"
    if record.get("failure_class"):
        detail += f" failure_class={record['failure_class']}"
    return Outcome(attempt, record.get("status"), code if isinstance(code, int) else None, detail)


def decide(
    run_dir: Path,
    failures_used: int,
    max_requeues: int,
    after_attempt: int = 0,
    unhealthy: tuple[str, ...] = (),
    seen_exits: tuple[int, ...] = (),
) -> Decision:
    """Requeue planned exits always, failures under the budget; stop on the rest.

    ``failures_used``: failure requeues this job already had (planned ones do not count);
    ``unhealthy``: nodes that failed the health check this attempt (a failure, requeued
    without them when the launcher can exclude them); ``seen_exits``: the exit codes the
    launcher logged for its workers this attempt, for a record the ranks could not finish."""
    outcome = read_outcome(run_dir, after_attempt)
    if outcome.status == "finished":
        return Decision(STOP, outcome.exit_code or exit_codes.OK, f"finished ({outcome.detail})")
    if outcome.status == "interrupted" or outcome.exit_code == exit_codes.INTERRUPTED:
        # The user's Ctrl-C: stopped as asked, after an emergency save; nothing to requeue.
        return Decision(STOP, exit_codes.INTERRUPTED, f"interrupted by the user ({outcome.detail})")
    if outcome.status == "preempted" or outcome.exit_code == exit_codes.REQUEUE:
        # A time-limit or preemption save: planned, not a failure; the budget is for failures.
        return Decision(
            REQUEUE,
            exit_codes.OK,
            f"planned requeue: preempted after an emergency save ({outcome.detail})",
            PLANNED,
        )
    if unhealthy:
        return _requeue(
            f"node(s) {', '.join(unhealthy)} failed the health check", failures_used, max_requeues
        )
    if outcome.exit_code in exit_codes.DO_NOT_RETRY:
        return Decision(
            STOP, outcome.exit_code, f"deterministic failure, not retried ({outcome.detail})"
        )
    unrecorded = outcome.status is None or outcome.status in KILLED_STATUSES
    if unrecorded and exit_codes.INTERRUPTED in seen_exits:  # a second Ctrl-C: no record left
        return Decision(STOP, exit_codes.INTERRUPTED, f"interrupted by the user ({outcome.detail})")
    deterministic = [c for c in seen_exits if c in exit_codes.DO_NOT_RETRY]
    # A worker killed by a signal (not the launcher's SIGTERM teardown) is an infrastructure
    # death whatever its peers exited with after it.
    killed = any(c < 0 and c != -signal.SIGTERM for c in seen_exits)
    if unrecorded and deterministic and not killed:
        # The ranks exited with a documented code but could not record it (the full disk that
        # stopped them): the launcher's own view of their exit decides, not a blind retry.
        return Decision(
            STOP,
            deterministic[0],
            f"deterministic failure, not retried: a worker exited {deterministic[0]} "
            f"(the launcher's log; {outcome.detail})",
        )
    if unrecorded:
        return _requeue(
            f"infrastructure: process killed or never recorded ({outcome.detail})",
            failures_used,
            max_requeues,
        )
    if outcome.exit_code is None or outcome.exit_code in RETRYABLE_CODES:
        return _requeue(f"infrastructure failure ({outcome.detail})", failures_used, max_requeues)
    # An exit code we do not know: retrying blindly could loop on a deterministic bug.
    return Decision(STOP, outcome.exit_code, f"unknown exit code, not retried ({outcome.detail})")


def _requeue(reason: str, failures_used: int, max_requeues: int) -> Decision:
    if failures_used >= max_requeues:
        return Decision(
            STOP,
            exit_codes.RETRY_BUDGET_EXHAUSTED,
            f"retry budget exhausted ({failures_used} of {max_requeues} failure requeues "
            f"used); last: {reason}",
        )
    return Decision(
        REQUEUE,
        exit_codes.OK,
        f"failure requeue {failures_used + 1} of {max_requeues}: {reason}",
        FAILURE,
    )


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m launch.retry_policy", description=__doc__.splitlines()[0]
    )
    parser.add_argument("run_dir", type=Path)
    parser.add_argument(
        "--newest-attempt",
        action="store_true",
        help="print the newest attempt id (0 if none) and exit",
    )
    parser.add_argument("--restart-count", type=int, default=0, help="SLURM_RESTART_COUNT")
    parser.add_argument("--max-requeues", type=int, default=0, help="failure requeues allowed")
    parser.add_argument(
        "--job-id",
        default=None,
        help="count failure requeues and exclusions in the run's ledger for this job "
        "(without it: every restart counts as a failure)",
    )
    parser.add_argument("--health-dir", type=Path, action="append", default=[])
    parser.add_argument("--job-nodes", type=int, default=0, help="SLURM_NNODES")
    parser.add_argument("--launch-nodes", type=int, default=0, help="launch.nodes")
    parser.add_argument("--min-nodes", type=int, default=0, help="launch.slurm.min_nodes")
    parser.add_argument("--max-excluded", type=int, default=0)
    parser.add_argument("--partition-nodes", type=int, default=0)
    parser.add_argument("--cpus-per-task", type=int, default=1, help="SLURM_CPUS_PER_TASK")
    parser.add_argument(
        "--job-log",
        type=Path,
        action="append",
        default=[],
        help="the job's log: finalize its attempts (root cause, work lost, recovery ledger) "
        "first; the first of several that exists is read (a node-local copy, then the run "
        "dir's, which a full disk may have cut short)",
    )
    parser.add_argument("--tokens-per-step", type=int, default=0)
    parser.add_argument(
        "--after-attempt",
        type=int,
        default=0,
        help="ignore attempt records with this id or lower (earlier runs)",
    )
    return parser.parse_args(argv)


def newest_attempt_exits(
    layout: RunLayout, attempts: list[int], events: LauncherEvents
) -> tuple[int, ...]:
    """The worker exit codes the launcher logged during the newest of ``attempts`` (from its
    record's start; else during the last launch): ft_launcher restarts its workers within one
    launch, and an earlier attempt's SIGKILL must not stand for this one's."""
    since = events.launches[-1][0] if events.launches else 0.0
    if attempts:
        since = read_record(layout, attempts[-1]).get("start_time", since)
    return tuple(e["exit_code"] for e in events.exits if e["time"] >= since)


def _job_log_exits(args: argparse.Namespace) -> tuple[int, ...]:
    """Finalize this job's attempts from the first of its logs that exists (read once); the
    worker exits its launchers logged during the newest attempt."""
    job_log = next((log for log in args.job_log if log.is_file()), None)
    if job_log is None:
        return ()
    layout = RunLayout.from_run_dir(args.run_dir)
    attempts = [a for a in recorded_attempts(layout) if a > args.after_attempt]
    events = launcher_events(job_log)
    finalize_job(layout, attempts, events, args.tokens_per_step)
    return newest_attempt_exits(layout, attempts, events)


def main(argv: list[str]) -> int:
    args = _parse(argv)
    if args.newest_attempt:
        print(newest_attempt(args.run_dir))
        return 0
    seen = _job_log_exits(args)
    unhealthy = sorted({n for d in args.health_dir for n in unhealthy_nodes(d)})
    if args.job_id is None:
        decision = decide(
            args.run_dir, args.restart_count, args.max_requeues, args.after_attempt, (), seen
        )
        print(decision.line(), flush=True)
        return decision.exit_code
    used = failures_used(args.run_dir, args.job_id)
    decision = decide(
        args.run_dir, used, args.max_requeues, args.after_attempt, tuple(unhealthy), seen
    )
    update = ""
    if decision.action == REQUEUE:
        update = _requeue_update(args, unhealthy, decision)
    print(decision.line(), flush=True)
    print(update, flush=True)  # the batch script's `scontrol update` arguments ("" = none)
    return decision.exit_code


def _requeue_update(args: argparse.Namespace, unhealthy: list[str], decision: Decision) -> str:
    """Record the requeue in the ledger; the scontrol update that leaves bad nodes out."""
    already = excluded_so_far(args.run_dir, args.job_id)
    exclusion = plan_exclusion(
        unhealthy,
        already,
        launch_nodes=args.launch_nodes or args.job_nodes,
        min_nodes=args.min_nodes or None,
        partition_nodes=args.partition_nodes or args.job_nodes,
        max_excluded=args.max_excluded,
    )
    if exclusion.note:
        print(f"nodes: {exclusion.note}", file=sys.stderr, flush=True)
    append_ledger(
        args.run_dir,
        {
            "job_id": args.job_id,
            "restart": args.restart_count,
            "kind": decision.kind,
            "reason": decision.reason,
            "unhealthy": unhealthy,
            "exclude": list(exclusion.exclude),
            "nodes": exclusion.nodes,
            "note": exclusion.note,
        },
    )
    return exclusion.scontrol_updates(args.job_nodes, args.cpus_per_task, already)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
