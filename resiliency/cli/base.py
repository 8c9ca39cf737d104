"""What a subcommand of ``python -m resiliency`` (or of another CLI built the same way) is, and
the exit codes every subcommand shares.

Exit codes follow diff, cmp and fsck, and argparse's own 2: a script can tell "the checkpoint is
bad" from "you called me wrong" without reading the output.

- ``EXIT_OK`` (0): done; every checkpoint checked verifies.
- ``EXIT_BAD`` (1): a checkpoint failed verification (``verify``, ``ls --verify``), or a run dir
  holds no step that verifies. Not ``CHECKPOINT_IO`` (10): that is the trainer's "could not
  save or restore", and a CLI that only read the files has nothing to retry.
- ``EXIT_USAGE`` (2, ``pretrain.context.exit_codes.CONFIG_ERROR``): bad arguments or config, a
  path that does not exist or is neither a step dir nor a run dir, a live run that ``gc`` must not
  touch.
- ``validate`` also exits 3 (``TOPOLOGY_REFUSED``) when the layout change is refused.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

from pretrain.context import exit_codes

EXIT_OK = exit_codes.OK
EXIT_BAD = 1
EXIT_USAGE = exit_codes.CONFIG_ERROR

EXIT_CODES_EPILOG = (
    f"exit codes: {EXIT_OK} ok; {EXIT_BAD} a checkpoint failed verification; "
    f"{EXIT_USAGE} usage or config error (bad path or argument); "
    f"{exit_codes.TOPOLOGY_REFUSED} (validate) layout change refused"
)


@dataclass(frozen=True)
class Command:
    help: str
    add_args: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    # Takes Hydra overrides (recipe=<name> key=value ...) as positional arguments.
    overrides: bool = False
    epilog: str = ""
