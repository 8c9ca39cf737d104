"""``python -m drill.equivalence [options] [key=value ...]``: is a resumed run the run that was
saved? Exit 0: the whole state is equal (and every control was caught); 1: a difference (the
first one named) or a control not caught; 2: bad arguments or a run that did not go as planned;
130: Ctrl-C (the job is stopped with it).
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from drill.equivalence.gate import GateConfig, GateResult, run_gate
from drill.jobs import DrillError
from pretrain.context import exit_codes
from resiliency.checkpoint.equivalence.compare import DumpError
from resiliency.cli import configure_cli_logging
from resiliency.cli.base import EXIT_BAD, EXIT_OK, EXIT_USAGE

SHOWN = 10  # differences printed (all are in the comparison)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, required=True, help="a new directory: runs, logs, dumps")
    p.add_argument("--nproc", type=int, default=2, help="ranks of the reference run")
    p.add_argument(
        "--resume-nproc",
        type=int,
        help="ranks of the resumed run (default --nproc; another number is a data-parallel "
        "change: use checkpoint.optim_format=fully_reshardable)",
    )
    p.add_argument("--step", type=int, default=2, help="the step saved, killed after, restored")
    p.add_argument(
        "--controls",
        action="store_true",
        help="also resume with the restore broken on purpose (an RNG stream, the expert-"
        "parallel RNG, Adam's step counter, one rank's data cursor, one parameter) and require "
        "the comparison to name each break",
    )
    p.add_argument("--rtol", type=float, default=1e-5, help="across a DP change, after step K")
    p.add_argument("overrides", nargs="*", help="recipe overrides (key=value)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m drill.equivalence",
        description="kill and resume a run; compare its whole state with an uninterrupted run's",
    )
    add_args(parser)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_term)  # unwind like Ctrl-C: the job is stopped
    configure_cli_logging(True)  # a few runs: progress on stderr, the verdict on stdout
    try:
        cfg = GateConfig(
            out=args.out,
            overrides=tuple(args.overrides),
            nproc=args.nproc,
            resume_nproc=args.resume_nproc,
            step=args.step,
            controls=args.controls,
            rtol=args.rtol,
        )
        result = run_gate(cfg)
    except (DrillError, DumpError) as exc:
        print(f"equivalence: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"equivalence: interrupted; the job was stopped (runs and logs in {args.out})",
              file=sys.stderr)  # fmt: skip
        return exit_codes.INTERRUPTED
    _print(result, cfg)
    return EXIT_OK if result.passed else EXIT_BAD


def _exit_on_term(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _print(result: GateResult, cfg: GateConfig) -> None:
    verdict = result.verdict
    how = (
        "byte for byte"
        if verdict.mode == "same layout"
        else f"(after step {cfg.step}: rtol {cfg.rtol:g})"
    )
    print(
        f"equivalence: {cfg.nproc} -> {cfg.resumed_world} ranks ({verdict.mode}), steps "
        f"{verdict.steps}: {verdict.compared} items compared {how}"
    )
    for item in verdict.not_compared:
        print(f"  not compared: {item}")
    if verdict.equivalent:
        print(f"  EQUAL: the resumed run holds the reference's state (dumps: {cfg.out / 'dumps'})")
    else:
        print(f"  DIFFERENT: {len(verdict.differences)} item(s); first: {verdict.differences[0]}")
        for difference in verdict.differences[1:SHOWN]:
            print(f"    {difference}")
    for name, hit in result.controls.items():
        print(f"  control {name}: " + (f"caught ({hit})" if hit else "NOT CAUGHT"))
    for name, why in result.skipped_controls.items():
        print(f"  control {name}: not run ({why})")
