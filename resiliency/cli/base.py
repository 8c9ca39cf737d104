"""What a subcommand of ``python -m resiliency`` (or of another CLI built the same way) is."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

EXIT_OK, EXIT_BAD, EXIT_USAGE = 0, 1, 2


@dataclass(frozen=True)
class Command:
    help: str
    add_args: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
