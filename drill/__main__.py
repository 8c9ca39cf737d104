"""``python -m drill [options] [key=value ...]``: the fault-recovery drill."""

from __future__ import annotations

import sys

from drill.cli import main

if __name__ == "__main__":
    sys.exit(main())
