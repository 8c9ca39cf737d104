"""A rank whose checkpoint writer died before reading a save request still exits at once."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.current_stack

# The writer is SIGKILLed from outside it (here: by its rank) before it reads anything; the
# request (more bytes than a pipe holds) then sits in the queue's feeder thread.
SCRIPT = """
import os, signal, sys
from resiliency.checkpoint.write.async_writer import SpawnedWriter
writer = SpawnedWriter(None)
writer.start()
os.kill(writer.process.pid, signal.SIGKILL)
writer.process.join()
writer._requests.put((0, print, [b"x" * (1 << 20)], {}))
sys.exit(3)
"""


def test_a_rank_whose_writer_died_unread_exits_without_waiting_for_it() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 3, proc.stderr[-3000:]
