"""Requeue or stop? Decided from the newest attempt record the trainer wrote, not exit codes.

The Slurm batch script calls this after its ``srun`` step ends. Launcher exit codes carry no
information (torchrun exits 1 with ChildFailedError whatever its workers returned), so the
decision reads ``<run_dir>/attempts/attempt-NN.json``, where the trainer's rank 0 records
``status`` and ``exit_code`` at exit. A record still saying starting/running means the process
was killed (node loss, OOM killer, time limit): an infrastructure failure.

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
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pretrain import exit_codes
from resiliency.storage.attempts import recorded_attempts
from resiliency.storage.layout import RunLayout

REQUEUE, STOP = "requeue", "stop"
KILLED_STATUSES = ("starting", "running")
RETRYABLE_CODES = (exit_codes.INFRASTRUCTURE, exit_codes.REQUEUE)


@dataclass(frozen=True)
class Decision:
    action: str  # "requeue" | "stop"
    exit_code: int  # what the batch script exits with (0 after a requeue)
    reason: str

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
    run_dir: Path, restart_count: int, max_requeues: int, after_attempt: int = 0
) -> Decision:
    """Requeue planned exits and infrastructure deaths under the budget; stop on the rest."""
    outcome = read_outcome(run_dir, after_attempt)
    if outcome.status == "finished":
        return Decision(STOP, outcome.exit_code or exit_codes.OK, f"finished ({outcome.detail})")
    if outcome.status == "preempted" or outcome.exit_code == exit_codes.REQUEUE:
        return _requeue(
            f"preempted after an emergency save ({outcome.detail})", restart_count, max_requeues
        )
    if outcome.exit_code in exit_codes.DO_NOT_RETRY:
        return Decision(
            STOP, outcome.exit_code, f"deterministic failure, not retried ({outcome.detail})"
        )
    if outcome.status is None or outcome.status in KILLED_STATUSES:
        return _requeue(
            f"infrastructure: process killed or never recorded ({outcome.detail})",
            restart_count,
            max_requeues,
        )
    if outcome.exit_code is None or outcome.exit_code in RETRYABLE_CODES:
        return _requeue(f"infrastructure failure ({outcome.detail})", restart_count, max_requeues)
    # An exit code we do not know: retrying blindly could loop on a deterministic bug.
    return Decision(STOP, outcome.exit_code, f"unknown exit code, not retried ({outcome.detail})")


def _requeue(reason: str, restart_count: int, max_requeues: int) -> Decision:
    if restart_count >= max_requeues:
        return Decision(
            STOP,
            exit_codes.RETRY_BUDGET_EXHAUSTED,
            f"retry budget exhausted ({restart_count} of {max_requeues} requeues "
            f"used); last: {reason}",
        )
    return Decision(
        REQUEUE, exit_codes.OK, f"requeue {restart_count + 1} of {max_requeues}: {reason}"
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
    parser.add_argument("--max-requeues", type=int, default=0)
    parser.add_argument(
        "--after-attempt",
        type=int,
        default=0,
        help="ignore attempt records with this id or lower (earlier runs)",
    )
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = _parse(argv)
    if args.newest_attempt:
        print(newest_attempt(args.run_dir))
        return 0
    decision = decide(args.run_dir, args.restart_count, args.max_requeues, args.after_attempt)
    print(decision.line(), flush=True)
    return decision.exit_code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
