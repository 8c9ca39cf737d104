"""Checkpoint subcommands: ls, verify (verify.py), gc. Exit codes: see base.py."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from resiliency.cli.attempt_table import attempt_rows
from resiliency.cli.base import EXIT_BAD, EXIT_OK, EXIT_USAGE, Command
from resiliency.cli.recorded import Setting, recorded_setting, schema_default
from resiliency.cli.remote import remote_ls
from resiliency.cli.run_arg import resolve_run_arg
from resiliency.cli.run_table import run_dirs, run_rows
from resiliency.cli.verify import VERIFY, add_signing_arg, cli_signing_key
from resiliency.monitor.goodput import build_ledger, format_ledger
from resiliency.storage.attempts import recorded_attempts
from resiliency.storage.layout import COMMITTED_NAME, RunLayout, parse_step, step_name
from resiliency.storage.lease import LeaseInfo, owner_liveness, read_lease
from resiliency.storage.retention import GcPlan, apply_gc, plan_gc
from resiliency.storage.select import read_latest_hint
from resiliency.storage.signing import SigningKey
from resiliency.storage.verify import verify_step_dir

DEFAULT_LEASE_TIMEOUT_S = 600.0


def _human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def _human_age(seconds: float) -> str:
    for limit, div, unit in ((120, 1, "s"), (7200, 60, "m"), (172800, 3600, "h")):
        if seconds < limit:
            return f"{seconds / div:.0f}{unit}"
    return f"{seconds / 86400:.0f}d"


def _dir_bytes(path: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += (Path(dirpath) / name).lstat().st_size
            except FileNotFoundError:
                pass
    return total


def _run_layout(run_dir: str) -> RunLayout | None:
    path = resolve_run_arg(run_dir)
    if isinstance(path, str):
        print(f"error: {path}")
        return None
    if not path.is_dir():
        print(f"error: {path} is not a directory")
        return None
    return RunLayout.from_run_dir(path)


def _lease_line(layout: RunLayout, default_timeout: float) -> tuple[str, LeaseInfo | None]:
    """Human description of the lease, and its info when a live owner holds it."""
    try:
        info = read_lease(layout)
    except ValueError as e:
        return f"unreadable ({e})", None
    if info is None:
        return "none", None
    alive, why = owner_liveness(info.host, info.pid, info.pid_ns, info.pid_start)
    if alive is False:
        return f"{info.describe()} [stale: {why}]", None
    beat = f"last beat written at {time.strftime('%H:%M:%S', time.localtime(info.heartbeat))}"
    state = "live" if alive else f"held: {why}; {beat} by its host's clock"
    return f"{info.describe()} [{state}]", info


def _header(layout: RunLayout, lease_timeout: float) -> LeaseInfo | None:
    hint, problem = read_latest_hint(layout)
    latest = f"step {hint}" if hint is not None else (f"invalid: {problem}" if problem else "none")
    lease_text, live = _lease_line(layout, lease_timeout)
    print(f"run:         {layout.run_dir} (run_id {layout.run_id})")
    print(f"latest.json: {latest}")
    print(f"lease:       {lease_text}")
    return live


_ROW = "{:>10}  {:<32}  {:<9}  {:<8}  {:>10}  {:>5}  {}"


def _row(*cols: object) -> str:
    return _ROW.format(*cols).rstrip()


def _step_row(
    layout: RunLayout,
    step: int,
    hint: int | None,
    now: float,
    full: bool,
    key: SigningKey | None = None,
) -> tuple[str, bool]:
    """The step's row, and whether it passed the check (``full``: every byte re-hashed;
    otherwise markers, manifest, file list and sizes only: the CHECK column says which; with
    ``key`` the manifest's signature too)."""
    path = layout.step_dir(step)
    verdict = verify_step_dir(path, layout.run_id, full=full, key=key)
    notes = (["latest"] if step == hint else []) + ([] if verdict.ok else [verdict.reason])
    check = ("crc ok" if full else "sizes ok") if verdict.ok else "BAD"
    row = _row(
        step,
        path.name,
        _yes((path / COMMITTED_NAME).is_file()),
        check,
        _human_bytes(_dir_bytes(path)),
        _human_age(now - path.stat().st_mtime),
        "; ".join(notes),
    )
    return row, verdict.ok


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def cmd_ls(args: argparse.Namespace) -> int:
    key = cli_signing_key(args.signing_key_env)
    if isinstance(key, str):
        print(key)
        return EXIT_USAGE
    if args.run_dir.startswith("s3://"):
        return remote_ls(args.run_dir, args.endpoint_url, args.verify, key)
    layout = _run_layout(args.run_dir)
    if layout is None:
        return EXIT_USAGE
    if not (layout.steps_dir.is_dir() or layout.attempts_dir.is_dir()):
        if runs := run_dirs(layout.run_dir):  # an output root: list its runs
            print(f"runs in {layout.run_dir} (ls <run dir> for one):")
            print("\n".join(run_rows(runs)))
            return EXIT_OK
    live = _header(layout, args.lease_timeout)
    hint, _ = read_latest_hint(layout)
    now = time.time()
    steps = list(reversed(layout.published_steps()))
    if not args.verify:
        print("check:       sizes and markers only (--verify re-hashes every byte)")
    print(_row("STEP", "DIR", "COMMITTED", "CHECK", "SIZE", "AGE", "NOTE"))
    all_ok = True
    for index, step in enumerate(steps, 1):
        if args.verify:  # progress on stderr: a full re-hash reads every byte of the step
            print(f"verifying {step_name(step)} ({index}/{len(steps)})", file=sys.stderr)
        row, ok = _step_row(layout, step, hint, now, args.verify, key)
        all_ok &= ok
        print(row, flush=True)
    _print_tmp_rows(layout, now)
    print(f"\nattempts:    {layout.attempts_dir}/attempt-NN.json, oldest first")
    print("\n".join(attempt_rows(layout, live.attempt if live else None, now)))
    print("\n" + format_ledger(build_ledger(layout.run_dir)).splitlines()[0])
    local_dir = args.local_dir or _recorded_local_dir(layout)
    if local_dir:
        _print_local_tier(Path(local_dir), layout.run_id)
    return EXIT_OK if all_ok or not (args.verify or key) else EXIT_BAD


def _print_tmp_rows(layout: RunLayout, now: float) -> None:
    for path, step, attempt in reversed(layout.tmp_dirs()):
        print(
            _row(
                step,
                path.name,
                _yes((path / COMMITTED_NAME).is_file()),
                "-",
                _human_bytes(_dir_bytes(path)),
                _human_age(now - path.stat().st_mtime),
                f"tmp of attempt {attempt:02d} (never restored from)",
            )
        )


def _recorded_local_dir(layout: RunLayout) -> str | None:
    """The local tier's dir as the newest attempt that used one recorded it."""
    for attempt in reversed(recorded_attempts(layout)):
        try:
            record = json.loads(layout.attempt_path(attempt).read_text())
        except (OSError, ValueError):
            continue
        if record.get("local_dir"):
            return str(record["local_dir"])
    return None


def _print_local_tier(local_dir: Path, run_id: str) -> None:
    # torch: only for runs with a local tier
    from resiliency.checkpoint.local.listing import describe_copies, scan_local_tier

    steps = scan_local_tier(local_dir, run_id)
    print(f"\nlocal tier:  {local_dir} (node-*/{run_id}/<rank>/; copies: shard owner -> where)")
    print(_LOCAL_ROW.format("STEP", "COMPLETE", "SIZE", "COPIES").rstrip())
    for record in steps:
        print(
            _LOCAL_ROW.format(
                record.step,
                _yes(record.complete),
                _human_bytes(record.bytes),
                describe_copies(record),
            ).rstrip()
        )
    if not steps:
        print("(no local checkpoints)")


_LOCAL_ROW = "{:>10}  {:<9}  {:>10}  {}"


def _print_plan(plan: GcPlan, dry_run: bool) -> None:
    verb = "would delete" if dry_run else "delete"
    for path, reason in sorted(plan.keep):
        print(f"keep          {path.name}: {reason}")
    for path, reason in plan.deletions:
        print(f"{verb:<13} {path.name}: {reason}")


def _gc_settings(layout: RunLayout, args: argparse.Namespace) -> tuple[Setting, Setting]:
    """keep_last and milestone_interval: the flags, else what the run recorded, else the
    schema's defaults; both printed with their source."""
    keep = (
        Setting(args.keep_last, "--keep-last")
        if args.keep_last is not None
        else recorded_setting(layout, "keep_last")
    )
    if args.milestone_interval is not None:  # 0: none, even where the run recorded one
        milestones = Setting(args.milestone_interval or None, "--milestone-interval")
    else:
        milestones = recorded_setting(layout, "milestone_interval")
    every = f"every {milestones.value} steps" if milestones.value else "none"
    print(f"keep_last:   {keep.value} ({keep.source})")
    print(f"milestones:  {every} ({milestones.source})")
    return keep, milestones


def cmd_gc(args: argparse.Namespace) -> int:
    layout = _run_layout(args.run_dir)
    if layout is None:
        return EXIT_USAGE
    if not (layout.steps_dir.is_dir() or layout.attempts_dir.is_dir()):
        if runs := run_dirs(layout.run_dir):  # an output root: list its runs
            print(f"runs in {layout.run_dir} (ls <run dir> for one):")
            print("\n".join(run_rows(runs)))
            return EXIT_OK
    live = _header(layout, args.lease_timeout)
    keep, milestones = _gc_settings(layout, args)
    if live is not None and not args.dry_run:
        print(
            f"error: run is live (lease held by attempt {live.attempt}); its trainer runs GC "
            f"with the steps it must protect. Use --dry-run, or stop the job first."
        )
        return EXIT_USAGE
    try:
        plan = plan_gc(
            layout,
            layout.run_id,
            _as_int(keep, "keep_last"),
            None if milestones.value is None else _as_int(milestones, "milestone_interval"),
            set(args.protect),
            live.attempt if live else None,
        )
    except ValueError as e:
        print(f"error: {e}")
        return EXIT_USAGE
    _print_plan(plan, args.dry_run)
    if args.dry_run:
        print(f"dry run: {len(plan.deletions)} dir(s) would be deleted")
        return EXIT_OK
    print(f"deleted {len(apply_gc(plan))} dir(s)")
    return EXIT_OK


def _as_int(setting: Setting, key: str) -> int:
    """A recorded value is the run's own file: a non-integer there is a config error."""
    if isinstance(setting.value, bool) or not isinstance(setting.value, int):
        raise ValueError(f"{key}={setting.value!r} ({setting.source}) is not an integer")
    return setting.value


def _add_lease_timeout(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--lease-timeout",
        type=float,
        default=DEFAULT_LEASE_TIMEOUT_S,
        help="heartbeat age after which a lease without a recorded timeout is stale",
    )


def _add_ls_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--endpoint-url", help="s3:// runs: the S3-compatible server (AWS_ENDPOINT_URL)")
    p.add_argument(
        "run_dir",
        help="<root>/<run_id>, a run id under the default output_dir (runs/), an output dir "
        "(its runs), or s3://bucket[/prefix]/<run_id> (the remote tier)",
    )
    p.add_argument(
        "--verify",
        action="store_true",
        help="re-hash every file of every published step (reads them all; exit 1 if any is bad)",
    )
    p.add_argument(
        "--local-dir",
        help="checkpoint.local.dir to list too (default: as the run's "
        "attempt records say; on a cluster, run on each node)",
    )
    add_signing_arg(p)
    _add_lease_timeout(p)


def _step_arg(value: str) -> int:
    step = parse_step(value) if value.startswith("step-") else None
    return step if step is not None else int(value)


def _add_gc_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="<root>/<run_id>, or a run id under the default output_dir")
    p.add_argument("--dry-run", action="store_true", help="print the plan, delete nothing")
    p.add_argument(
        "--keep-last",
        type=int,
        default=None,
        help="verified steps to keep (>= 2; default: the run's recorded checkpoint.keep_last, "
        "from config.yaml, launch-config.yaml or the newest manifest, else the schema's "
        f"{schema_default('keep_last')})",
    )
    p.add_argument(
        "--milestone-interval",
        type=int,
        default=None,
        help="also keep every step divisible by N (0: none; default: the run's recorded "
        "checkpoint.milestone_interval)",
    )
    p.add_argument(
        "--protect",
        type=_step_arg,
        nargs="*",
        default=[],
        metavar="STEP",
        help="steps never to delete",
    )
    _add_lease_timeout(p)


COMMANDS = {
    "ls": Command(
        "list a run's steps, tmp dirs, attempts (status, exit, failure class, restored step); "
        "an output dir: its runs",
        _add_ls_args,
        cmd_ls,
    ),
    "verify": VERIFY,
    "gc": Command(
        "delete old steps and dead attempts' tmp dirs (keeps the run's checkpoint.keep_last)",
        _add_gc_args,
        cmd_gc,
    ),
}
