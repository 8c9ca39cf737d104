"""``python -m resiliency <command>``: ls, verify, gc, validate, capacity (``--help`` lists them),
and soak, which is ``python -m drill.soak``."""

from __future__ import annotations

import os
import sys
import warnings

# The chaos soak launches jobs, an application above this package: the command is handed to
# the drill's own entry point (a new program, not an import, so the layers stay as they are).
SOAK = ("soak", ["-m", "drill.soak"])

if __name__ == "__main__":
    if sys.argv[1:2] == [SOAK[0]]:
        os.execv(sys.executable, [sys.executable, *SOAK[1], *sys.argv[2:]])
    # torch/megatron import-time deprecation notes are noise in a CLI's output: filter them
    # before the commands (and torch with them) are imported.
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    from resiliency.cli import main

    sys.exit(main())
