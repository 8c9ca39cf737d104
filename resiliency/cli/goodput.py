"""``python -m resiliency goodput RUN``: where a run's wall time went (monitor/goodput.py)."""

from __future__ import annotations

import argparse
import json

from pretrain.context.run_dir import RunDir
from resiliency.cli.base import EXIT_OK, EXIT_USAGE, Command
from resiliency.cli.run_arg import resolve_run_arg
from resiliency.monitor.goodput import build_ledger, format_ledger
from resiliency.monitor.recovery import format_recovery, recoveries
from resiliency.monitor.resizes import format_resizes, resizes, throughput_by_size


def _add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "run_dir", help="a run dir: <output_dir>/<run_id>, or a run id under the default output_dir"
    )
    parser.add_argument("--json", action="store_true", help="the ledger as JSON")


def cmd_goodput(args: argparse.Namespace) -> int:
    run_dir = resolve_run_arg(args.run_dir)
    if isinstance(run_dir, str):
        print(f"error: {run_dir}")
        return EXIT_USAGE
    if not RunDir(run_dir).attempts_dir.is_dir():
        print(f"error: {run_dir} is not a run dir (no attempts/ in it)")
        return EXIT_USAGE
    ledger, faults = build_ledger(run_dir), recoveries(run_dir)
    resized, sizes = resizes(run_dir), throughput_by_size(run_dir)
    if args.json:
        report = {**ledger.to_dict(), "recoveries": faults, "resizes": resized, "sizes": sizes}
        print(json.dumps(report, indent=1))
        return EXIT_OK
    print(format_ledger(ledger))
    for attempt, rto in faults.items():
        print(format_recovery(attempt, rto))
    if resized or len(sizes) > 1:
        print(format_resizes(resized, sizes))
    return EXIT_OK


COMMANDS = {
    "goodput": Command(
        "goodput of a run: productive step time / wall time, with the rest by category",
        _add_args,
        cmd_goodput,
        epilog="Categories: productive, lost (recomputed), checkpoint_save, evaluation, "
        "startup, restore, downtime (between attempts), other; they add up to the wall time. "
        "Then, per fault, its recovery ledger: detection, teardown, spawn, imports, process "
        "group, setup, model build, restore read and load, first step, and the work lost; "
        "for an elastic run (parallel.elastic), each resize and the throughput at each size.",
    ),
}
