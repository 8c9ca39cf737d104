"""Arguments and exit codes of ``python -m resiliency.hf``.

Exit codes: 0 done (and, with a check, within tolerance); 1 the step does not verify, or the
exported model's validation loss is off by more than ``--tolerance``; 2 usage or config error
(no such path, a model with no transformers family, a tokenizer that cannot be read or
converted, an output dir in the way or not writable); 70 an unexpected error (a bug: one line,
the traceback with ``--debug``). Nothing else exits 1: a script reads 1 as "the checkpoint
is bad".
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from pretrain.context import exit_codes
from pretrain.data.tokenizer import TokenizerError
from pretrain.platform.logs import setup_logging
from recipes import ConfigError

log = logging.getLogger("resiliency.hf")
# As python -m resiliency's (resiliency/cli/base.py): 1 is "the checkpoint (or check) is bad".
EXIT_OK, EXIT_BAD, EXIT_USAGE = exit_codes.OK, 1, exit_codes.CONFIG_ERROR
EXIT_INTERNAL = os.EX_SOFTWARE  # 70: a bug, never mistaken for "the step does not verify"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m resiliency.hf",
        description="Export checkpoints to Hugging Face transformers, import from it.",
        epilog=f"exit codes: {EXIT_OK} ok; {EXIT_BAD} the step does not verify or the check "
        f"failed; {EXIT_USAGE} usage or config error; {EXIT_INTERNAL} an unexpected error (a bug)",
    )
    parser.add_argument(
        "--debug", action="store_true", help="log DEBUG, and the traceback of an unexpected error"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    export = sub.add_parser("export", help="a published step -> a transformers model directory")
    export.add_argument("step_dir", type=Path, help="a published step: <run dir>/steps/step-N")
    export.add_argument("--out", type=Path, required=True, help="the directory to write")
    export.add_argument("--force", action="store_true", help="replace a non-empty --out")
    export.add_argument(
        "--run-id",
        help="the run the step must belong to (default: the one its manifest records, so a "
        "copied or renamed run exports as it is)",
    )
    export.add_argument(
        "--check",
        action="store_true",
        help="load the export in transformers and compare its loss on the run's validation "
        "batches with the validation loss the run logged at this step",
    )
    export.add_argument(
        "--tolerance",
        type=float,
        default=0.01,
        help="largest relative loss gap --check accepts (default 0.01 = 1%%)",
    )
    imp = sub.add_parser(
        "import",
        help="a transformers model directory -> step 0 of a new run (weights only)",
        description="Publish a transformers model as step 0 of run <run_id>; train that run "
        "(any layout) to continue pretraining it with a fresh optimizer.",
    )
    imp.add_argument("hf_dir", type=Path, help="a local transformers model directory")
    imp.add_argument("overrides", nargs="+", help="recipe=<name> run_id=<new run> key=value ...")
    return parser


def run_export(args: argparse.Namespace) -> int:
    if not args.step_dir.is_dir():
        log.error("export: %s is not a directory (give <run dir>/steps/step-N)", args.step_dir)
        return EXIT_USAGE
    # torch and megatron-core: not for --help
    from resiliency.hf.export import ExportError, StepNotVerified, export_step

    try:
        step = export_step(args.step_dir, args.out, args.force, args.run_id)
    except ExportError as exc:
        log.error("export: %s", exc)
        return EXIT_BAD if isinstance(exc, StepNotVerified) else EXIT_USAGE
    print(f"exported step {step.manifest.step} of {step.manifest.run_id} to {args.out}")
    if not args.check:
        return EXIT_OK
    # heavy (transformers, megatron datasets): only for --check
    from resiliency.hf.check import hf_validation_loss

    try:
        result = hf_validation_loss(args.out, step)
    except ImportError as exc:
        log.error("export --check needs the hf extra (pip install transformers): %s", exc)
        return EXIT_USAGE
    except ValueError as exc:
        log.error("export --check: %s", exc)
        return EXIT_USAGE
    if result.run_loss is None:
        print(
            f"validation loss: transformers {result.hf_loss:.6f}; the run did not validate "
            f"at step {step.manifest.step}, nothing to compare with"
        )
        return EXIT_OK
    gap = result.relative_gap or 0.0
    verdict = "ok" if gap <= args.tolerance else f"FAILED (tolerance {args.tolerance:.2%})"
    print(
        f"validation loss: transformers {result.hf_loss:.6f} vs run {result.run_loss:.6f} "
        f"({gap:.3%} apart): {verdict}"
    )
    return EXIT_OK if gap <= args.tolerance else EXIT_BAD


def run_import(args: argparse.Namespace) -> int:
    # heavy (megatron-core, the model): only for import
    from resiliency.hf.import_ import import_hf

    if not args.hf_dir.is_dir():
        log.error("import: %s is not a directory", args.hf_dir)
        return EXIT_USAGE
    try:
        step_dir = import_hf(args.hf_dir, args.overrides)
    except (ConfigError, TokenizerError) as exc:
        log.error("%s", exc)
        return EXIT_USAGE
    run_id = step_dir.parent.parent.name
    print(
        f"imported {args.hf_dir} as {step_dir}; continue pretraining it with the same "
        f"recipe and run_id={run_id} (any layout): it resumes from step 0 with a fresh optimizer"
    )
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging("DEBUG" if args.debug else "INFO")
    try:
        return {"export": run_export, "import": run_import}[args.command](args)
    except Exception as exc:  # noqa: BLE001 - an uncaught error would exit 1, "does not verify"
        log.error(
            "%s failed unexpectedly: %s: %s (a bug; --debug logs the traceback)",
            args.command,
            type(exc).__name__,
            " ".join(str(exc).split()),
        )
        log.debug("traceback", exc_info=True)
        return EXIT_INTERNAL
