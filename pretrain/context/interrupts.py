"""Ctrl-C (SIGINT) as a stop request, in every process that trains.

The first SIGINT only sets a flag: the ranks agree on it at the end of the step in flight (the
step's own all-reduce, ``Trainer._reduce_loss``), make the emergency save and exit
``INTERRUPTED`` (130). One Ctrl-C often arrives more than once (a terminal signals the whole
process group and a launcher forwards the same signal), so a SIGINT within ``SAME_PRESS_S`` of
the first is the same press. A second press after that stops the process at once, without a
save, and says so: the last published step is intact, the lease is taken over on relaunch.

Only the flag and the clock are touched in the handler (it may run between any two bytecodes
of the main thread); the one line of a second press is written with ``os.write``, since the
logging module's locks may be held by the code the signal interrupted.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import time
from collections.abc import Callable
from types import FrameType

from pretrain.context import exit_codes

SAME_PRESS_S = 1.0
_first_at: float | None = None
_installed = False


def install() -> None:
    """SIGINT sets the stop flag from now on in this process (main thread only)."""
    global _installed
    signal.signal(signal.SIGINT, _on_sigint)
    _installed = True


def installed() -> bool:
    return _installed


def requested() -> bool:
    """A Ctrl-C reached this process since ``install``."""
    return _first_at is not None


def _on_sigint(signum: int, frame: FrameType | None) -> None:
    global _first_at
    now = time.monotonic()
    if _first_at is None:
        _first_at = now
        return
    if now - _first_at < SAME_PRESS_S:
        return  # the same press, delivered again by a launcher
    rank = os.environ.get("RANK", "0")
    line = f"[rank {rank}] second Ctrl-C: stopping now, without an emergency save\n"
    try:
        os.write(2, line.encode())
    except OSError:
        pass  # stderr gone (the launcher's pipe closed): the exit code still says it
    os._exit(exit_codes.INTERRUPTED)


Main = Callable[[list[str]], int]


def one_line_on_ctrl_c(when: str) -> Callable[[Main], Main]:
    """For a command's ``main(argv) -> exit code``: a Ctrl-C that reaches it as a
    KeyboardInterrupt (before ``install`` or a launcher's own handlers took SIGINT over) is
    one line, ``interrupted (Ctrl-C) <when>`` (said by rank 0 only), and exit 130."""

    def wrap(main: Main) -> Main:
        @functools.wraps(main)
        def guarded(argv: list[str]) -> int:
            try:
                return main(argv)
            except KeyboardInterrupt:
                if os.environ.get("RANK", "0") == "0":
                    logging.getLogger(main.__module__).warning("interrupted (Ctrl-C) %s", when)
                return exit_codes.INTERRUPTED

        return guarded

    return wrap


def reset_for_tests() -> None:
    global _first_at, _installed
    _first_at, _installed = None, False
