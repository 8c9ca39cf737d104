"""``python -m drill.soak``: the chaos soak.

Runs a job under the fault-tolerant launcher with faults at exponentially distributed times
(:mod:`drill.soak.plan`), then proves nothing was lost: the final loss trajectory equals a
clean run of the same config bit for bit (:mod:`drill.soak.report`). Exit 0 if it does and
every fault fired, 1 if not, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from drill.jobs import DrillError
from drill.soak.outside import OUTSIDE_KINDS, judge_outside, trajectory_problems
from drill.soak.plan import KINDS, SoakConfig, SoakRuns, run_soak
from drill.soak.report import judge
from resiliency.cli import configure_cli_logging
from resiliency.cli.base import EXIT_BAD, EXIT_OK, EXIT_USAGE


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, required=True, help="output dir (report, runs, logs)")
    p.add_argument("--minutes", type=float, default=5.0, help="training time of the job")
    p.add_argument("--mtbf", type=float, default=30.0, help="mean training seconds per fault")
    p.add_argument("--mtbf-steps", type=float, help="mean steps between faults (not --mtbf)")
    p.add_argument(
        "--mtbf-x-cost",
        type=float,
        help="MTBF = this x (save + start cost), measured on the clean run (not --mtbf)",
    )
    p.add_argument("--steps", type=int, help="train this many steps (instead of --minutes)")
    p.add_argument("--nproc", type=int, default=2, help="ranks on this machine")
    p.add_argument("--seed", type=int, help="fault schedule seed (in the report; rerun with it)")
    p.add_argument(
        "--outside",
        action="store_true",
        help="the soak process injects the faults into the running job (signals to ranks and "
        "writers, a flipped byte, a full disk, an S3 outage: "
        f"{','.join(OUTSIDE_KINDS)}), not the trainer's own injection points; full_disk "
        "needs root (the soak run gets a tmpfs of its own), s3_outage "
        "checkpoint.remote.url and an http:// AWS_ENDPOINT_URL",
    )
    p.add_argument(
        "--kinds",
        help=f"comma-separated fault kinds (default: all of {','.join(KINDS)}; "
        f"with --outside {','.join(OUTSIDE_KINDS)})",
    )
    p.add_argument("overrides", nargs="*", help="recipe overrides (key=value)")


def config_from_args(args: argparse.Namespace) -> SoakConfig:
    known = OUTSIDE_KINDS if args.outside else KINDS
    kinds = tuple(k for k in (args.kinds or ",".join(known)).split(",") if k)
    unknown = sorted(set(kinds) - set(known))
    if unknown or not kinds:
        raise DrillError(f"--kinds: unknown {unknown or 'none given'}; choose from {list(known)}")
    if min(args.mtbf, args.minutes, args.mtbf_steps or 1, args.mtbf_x_cost or 1) <= 0:
        raise DrillError("--mtbf, --mtbf-steps, --mtbf-x-cost and --minutes must be > 0")
    if args.steps is not None and args.steps < 4:
        raise DrillError("--steps must be >= 4")
    return SoakConfig(
        out=args.out,
        overrides=tuple(args.overrides),
        minutes=args.minutes,
        mtbf_s=args.mtbf,
        mtbf_steps=args.mtbf_steps,
        mtbf_cost_multiple=args.mtbf_x_cost,
        steps=args.steps,
        nproc=args.nproc,
        seed=args.seed,
        kinds=kinds,
        outside=args.outside,
        kinds_given=args.kinds is not None,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m drill.soak",
        description="run a job under random faults; prove its trajectory equals a clean run's",
    )
    add_args(parser)
    args = parser.parse_args(argv)
    # SIGTERM unwinds like Ctrl-C: the job is stopped, a mounted tmpfs and the proxy undone.
    signal.signal(signal.SIGTERM, _exit_on_term)
    configure_cli_logging(True)  # minutes of work: progress on stderr, the verdict on stdout
    try:
        runs = run_soak(config_from_args(args))
    except DrillError as exc:
        print(f"soak: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if runs.outside is not None:
        return _outside_verdict(runs)
    verdict = judge(runs)
    print(verdict.summary)
    for problem in verdict.problems:
        print(f"  problem: {problem}")
    return EXIT_OK if verdict.passed else EXIT_BAD


def _exit_on_term(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _outside_verdict(runs: SoakRuns) -> int:
    outside = runs.outside
    assert outside is not None
    dirs = (runs.run_dir("clean"), runs.run_dir("soak"), runs.steps)
    problems = judge_outside(outside, *dirs)
    exact = not trajectory_problems(*dirs)
    confirmed = sum(i.confirmed for i in outside.injected)
    print(
        f"soak (outside, seed {runs.seed}): {len(outside.plan)} fault(s) planned, "
        f"{len(outside.injected)} injected, {confirmed} confirmed by the launcher's log and "
        f"the OS, {len(outside.skipped)} not injected; trajectory "
        f"{'bit-exact' if exact else 'NOT bit-exact'} against the clean run"
    )
    for injection in outside.injected:
        print(f"  {injection.kind} rank {injection.rank}: {injection.evidence}")
    for problem in problems:
        print(f"  problem: {problem}")
    return EXIT_OK if not problems else EXIT_BAD
