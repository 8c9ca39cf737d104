"""The rank's spawned checkpoint writer: signals during its start-up, a writer gone unread."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.current_stack

# The writer is SIGKILLed from outside it (here: by its rank) before it reads anything; the
# request (more bytes than a pipe holds) then sits in the queue's feeder thread.
DIED_UNREAD = """
import os, signal, sys
from resiliency.checkpoint.write.async_writer import SpawnedWriter
writer = SpawnedWriter(None)
writer.start()
os.kill(writer.process.pid, signal.SIGKILL)
writer.process.join()
writer._requests.put((0, print, [b"x" * (1 << 20)], {}))
sys.exit(3)
"""

# Slurm's SIGTERM/SIGUSR1 and torchrun's SIGINT reach every process of the rank, also in the
# seconds the writer spends importing torch before its own code runs (CI once lost an
# emergency save that way: the writer died of a KeyboardInterrupt mid-import). The rank sends
# them every 10 ms from the moment the writer exists until it is ready for work.
SIGNALLED_AT_START = """
import os, signal, time
from resiliency.checkpoint.write.async_writer import SpawnedWriter
writer = SpawnedWriter(None)
writer.start()
sent, end = 0, time.monotonic() + 6
while time.monotonic() < end and writer.process.is_alive():
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        os.kill(writer.process.pid, sig)
    sent += 1
    time.sleep(0.01)
alive = writer.process.is_alive()
process = writer.process
writer.close()
print(f"sent={sent} alive={alive} exitcode={process.exitcode} "
      f"rank_mask={sorted(signal.pthread_sigmask(signal.SIG_BLOCK, []))}")
"""


def _python(script: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60
    )


def test_a_rank_whose_writer_died_unread_exits_without_waiting_for_it() -> None:
    proc = _python(DIED_UNREAD)
    assert proc.returncode == 3, proc.stderr[-3000:]


def test_signals_during_the_writers_start_up_neither_kill_it_nor_stay_blocked_in_the_rank() -> None:
    proc = _python(SIGNALLED_AT_START)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = proc.stdout.strip().splitlines()[-1]
    fields = dict(part.split("=", 1) for part in line.split(" "))
    assert int(fields["sent"]) > 50, line  # signals did arrive during the imports
    assert fields["alive"] == "True", line
    # Closed normally (it read the stop request), not killed: exit code 0.
    assert fields["exitcode"] == "0", line
    assert fields["rank_mask"] == "[]", line
    assert "KeyboardInterrupt" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
