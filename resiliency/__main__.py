"""``python -m resiliency <command>``: ls, verify, gc, validate, plan (``--help`` lists them)."""

from __future__ import annotations

import sys
import warnings

if __name__ == "__main__":
    # torch/megatron import-time deprecation notes are noise in a CLI's output: filter them
    # before the commands (and torch with them) are imported.
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    from resiliency.cli import main

    sys.exit(main())
