"""``python -m resiliency <command>`` (the console script ``mcore-ckpt``): ls, verify, gc,
validate, capacity (``--help`` lists them).

The chaos soak launches jobs, an application above this package: it is ``python -m
drill.soak``; ``resiliency soak`` only names that command (exit 2) and starts nothing."""

from __future__ import annotations

import os
import signal
import sys
import warnings


def cli() -> None:
    """``mcore-ckpt`` (pyproject.toml's scripts): ``python -m resiliency``, same exit codes."""
    argv = sys.argv[1:]
    if argv[:1] == ["soak"]:
        args = " ".join(argv[1:])
        print(f"the soak is: python -m drill.soak {args}".rstrip(), file=sys.stderr)
        sys.exit(2)
    # torch/megatron import-time deprecation notes are noise in a CLI's output: filter them
    # before the commands (and torch with them) are imported.
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    from resiliency.cli import main

    try:
        code = main(argv)
        sys.stdout.flush()
    except BrokenPipeError:
        # `ls ... | head` closed the pipe: the reader has what it wanted. Point stdout at
        # /dev/null so the interpreter's own flush at exit cannot raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 128 + signal.SIGPIPE  # what a shell reports for a writer whose reader left
    sys.exit(code)


if __name__ == "__main__":
    cli()
