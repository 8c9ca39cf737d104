"""``python -m resiliency <command>``: ls, verify, gc, validate."""

from __future__ import annotations

import sys
import warnings

from resiliency.cli import main

if __name__ == "__main__":
    # torch/megatron import-time deprecation notes are noise in a CLI's output.
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    sys.exit(main())
