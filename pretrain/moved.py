"""Commands that moved: each old name only says the new one (exit 2, the usage code).

A command lives in the layer that owns its work, so these modules import nothing and start
nothing: a relaunch with an old command never silently does something else.
"""

from __future__ import annotations

import sys


def say_moved(old: str, new: str) -> None:
    args = " ".join(sys.argv[1:])
    print(f"python -m {old} is now: python -m {new} {args}".rstrip(), file=sys.stderr)
    sys.exit(2)
