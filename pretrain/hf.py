"""``python -m pretrain.hf export|import``: Hugging Face transformers interop.

The commands read and publish checkpoints, which the resiliency package owns (a layer above
this one); like ``python -m resiliency soak``, the command is handed to that package's own
entry point as a new program, so no import crosses the layers.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
    os.execv(sys.executable, [sys.executable, "-m", "resiliency.hf", *sys.argv[1:]])
