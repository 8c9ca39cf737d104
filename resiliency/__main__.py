"""``python -m resiliency <command>``: ls, verify, gc, validate, capacity (``--help`` lists them).

The chaos soak launches jobs, an application above this package: it is ``python -m
drill.soak``; ``resiliency soak`` only names that command (exit 2) and starts nothing."""

from __future__ import annotations

import sys
import warnings

if __name__ == "__main__":
    if sys.argv[1:2] == ["soak"]:
        args = " ".join(sys.argv[2:])
        print(f"the soak is: python -m drill.soak {args}".rstrip(), file=sys.stderr)
        sys.exit(2)
    # torch/megatron import-time deprecation notes are noise in a CLI's output: filter them
    # before the commands (and torch with them) are imported.
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    from resiliency.cli import main

    sys.exit(main())
