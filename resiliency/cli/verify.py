"""``verify``: is this step dir, or every published step of this run dir, an intact checkpoint?

A step dir (``<run>/steps/step-NNNNNNNNN``, or a tmp dir) gets one ``OK``/``BAD`` line. A run
dir (or its ``steps/``) gets one line per published step, newest first, and a summary; with
``--newest`` it stops at the newest step that verifies, the one a restore would pick.
Exit codes (base.py): 0 everything checked verifies (``--newest``: a step verifies); 1 a
checkpoint failed, or the run has no published step; 2 the path does not exist or is neither
a step dir nor a run dir.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pretrain.context.run_dir import RunDir
from recipes.checks import ConfigError
from resiliency.cli.base import EXIT_BAD, EXIT_OK, EXIT_USAGE, Command
from resiliency.cli.remote import remote_verify
from resiliency.cli.run_arg import resolve_run_arg
from resiliency.storage.layout import RunLayout
from resiliency.storage.signing import SigningKey, key_from_env
from resiliency.storage.verify import expected_run_id, step_of_dir, verify_step_dir


def _classify(path: Path) -> tuple[str, Path] | str:
    """("step" | "run", dir), or why the path is neither (a usage error, not a bad step)."""
    if not path.exists():
        return f"{path} does not exist"
    if not path.is_dir():
        return f"{path} is a file; give a step dir (<run>/steps/step-NNNNNNNNN) or a run dir"
    if step_of_dir(path) is not None:
        return "step", path
    if path.name == "steps":  # <run>/steps: its run
        return "run", path.parent
    if any(marker.exists() for marker in RunDir(path).markers):
        return "run", path
    runs = sorted(p.name for p in path.iterdir() if RunDir(p).steps_dir.is_dir())
    hint = f"; it holds run dir(s): {', '.join(runs[:5])}{' ...' * (len(runs) > 5)}" if runs else ""
    return (
        f"{path} is neither a step dir (step-NNNNNNNNN) nor a run dir "
        f"(no steps/, attempts/ or run.json inside){hint}"
    )


def cli_signing_key(name: str | None) -> SigningKey | None | str:
    """``--signing-key-env NAME``: the key, None when not asked, or the error to print."""
    try:
        return key_from_env(name)
    except ConfigError as exc:
        return f"error: {exc}"


def cmd_verify(args: argparse.Namespace) -> int:
    key = cli_signing_key(args.signing_key_env)
    if isinstance(key, str):
        print(key)
        return EXIT_USAGE
    if args.path.startswith("s3://"):
        return remote_verify(args.path, args.endpoint_url, not args.quick, key)
    path = resolve_run_arg(args.path)
    target = path if isinstance(path, str) else _classify(path.absolute())
    if isinstance(target, str):
        print(f"error: {target}")
        return EXIT_USAGE
    kind, path = target
    if kind == "run":
        return _verify_run(path, args.run_id, not args.quick, args.newest, key)
    run_id, note = expected_run_id(path, args.run_id)
    if note:
        print(f"note: {note}")
    verdict = verify_step_dir(path, run_id, full=not args.quick, key=key)
    print(f"{'OK' if verdict.ok else 'BAD'} {path}: {verdict.reason}")
    return EXIT_OK if verdict.ok else EXIT_BAD


def _verify_run(
    run_dir: Path, run_id: str | None, full: bool, newest: bool, key: SigningKey | None = None
) -> int:
    layout = RunLayout.from_run_dir(run_dir)
    steps = list(reversed(layout.published_steps()))
    expected = run_id or layout.run_id
    if steps and run_id is None:  # a copied run: its steps name the run they belong to
        expected, note = expected_run_id(layout.step_dir(steps[0]))
        if note:
            print(f"note: {note}")
    if not steps:
        print(f"BAD {run_dir}: no published step to verify (nothing under steps/)")
        return EXIT_BAD
    check = "full: every byte re-hashed" if full else "quick: markers, manifest and sizes"
    scope = "the newest step that verifies" if newest else f"all {len(steps)} published step(s)"
    print(f"run {run_dir}: verifying {scope}, newest first ({check})")
    bad: list[int] = []
    good: list[int] = []
    for index, step in enumerate(steps, 1):
        if full:  # progress on stderr: a full re-hash reads every byte of the step
            print(f"verifying step {step} ({index}/{len(steps)})", file=sys.stderr)
        verdict = verify_step_dir(layout.step_dir(step), expected, full=full, key=key)
        (good if verdict.ok else bad).append(step)
        status = "OK " if verdict.ok else "BAD"
        print(f"{status} {layout.step_dir(step).name}: {verdict.reason}", flush=True)
        if newest and verdict.ok:
            break
    print(_summary(good, bad, newest))
    if newest:
        return EXIT_OK if good else EXIT_BAD
    return EXIT_BAD if bad else EXIT_OK


def _summary(good: list[int], bad: list[int], newest: bool) -> str:
    if not good:
        return f"BAD: none of {len(bad)} published step(s) verifies; nothing to resume from"
    pick = f"newest verified: step {good[0]} (a restore picks it)"
    if newest:
        skipped = f", {len(bad)} newer step(s) BAD" if bad else ""
        return f"{pick}{skipped}"
    if bad:
        return f"BAD: {len(bad)} of {len(good) + len(bad)} step(s) fail ({_steps(bad)}); {pick}"
    return f"OK: all {len(good)} step(s) verify; {pick}"


def _steps(steps: list[int]) -> str:
    return f"step{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps))}"


def _add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "path",
        help="a step dir (<root>/<run_id>/steps/step-NNNNNNNNN), or a run dir (<root>/<run_id>):"
        " every published step of it; a relative path that does not exist is looked up under"
        " the default output_dir (runs/): <run_id>[/steps/step-N]; s3://bucket[/prefix]/"
        "<run_id>[/steps/step-N] on the remote tier (full: every object downloaded and"
        " re-hashed)",
    )
    p.add_argument("--quick", action="store_true", help="check sizes only, skip checksums")
    p.add_argument(
        "--newest",
        action="store_true",
        help="run dir: stop at the newest step that verifies (the one a restore picks)",
    )
    p.add_argument(
        "--run-id",
        help="the run the steps must belong to (default: the one their manifests record)",
    )
    p.add_argument("--endpoint-url", help="s3:// runs: the S3-compatible server (AWS_ENDPOINT_URL)")
    add_signing_arg(p)


def add_signing_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--signing-key-env",
        metavar="NAME",
        help="the environment variable holding the run's key (checkpoint.signing_key_env): "
        "a step whose manifest is not signed with it is BAD",
    )


VERIFY = Command(
    "verify a step dir, or every published step of a run dir (exit 0 ok, 1 bad, 2 usage)",
    _add_args,
    cmd_verify,
    epilog="A run dir: one line per published step, newest first, then a summary line.",
)
