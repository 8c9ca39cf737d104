"""``python -m pretrain.hf``: moved to ``python -m resiliency.hf export|import``.

Export and import read and publish checkpoints, which the resiliency package owns (a layer
above this one), so the command lives there. This module only says so (exit 2, the usage code):
it imports nothing and starts nothing.
"""

from __future__ import annotations

import sys

if __name__ == "__main__":
    args = " ".join(sys.argv[1:])
    print(f"python -m pretrain.hf is now: python -m resiliency.hf {args}".rstrip(), file=sys.stderr)
    sys.exit(2)
