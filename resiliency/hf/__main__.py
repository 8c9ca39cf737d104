"""``python -m resiliency.hf export|import``."""

from __future__ import annotations

import sys
import warnings

if __name__ == "__main__":
    # torch/megatron import-time deprecation notes are noise in a CLI's output.
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    from resiliency.hf.cli import main

    sys.exit(main())
