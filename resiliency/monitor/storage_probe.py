"""Whether a directory's storage answers: a small file written, fsynced and removed by a child
process, which is abandoned (never waited for) when no answer comes in time.

A thread would not do: a thread blocked in a call on a hung NFS, Lustre or FUSE mount keeps
its whole process from exiting, so a launcher that asked from a thread could never leave; a
child stuck the same way is simply left behind (it ends when the storage answers, or with the
node). Only a missing answer counts: an answer that is an error (a full or read-only file
system) is the other checks' business, and the storage did answer.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

# The nearest existing directory at or above the argument (a new run's dir does not exist
# yet): a file in it written, fsynced, removed. -I -S: no site packages, ~20 ms to start.
_PROBE = (
    "import os, sys\n"
    "d = sys.argv[1]\n"
    "while not os.path.isdir(d) and os.path.dirname(d) != d: d = os.path.dirname(d)\n"
    "p = os.path.join(d, '.storage-probe-%d' % os.getpid())\n"
    "fd = os.open(p, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)\n"
    "try:\n"
    "    os.write(fd, b'probe'); os.fsync(fd)\n"
    "finally:\n"
    "    os.close(fd); os.unlink(p)\n"
)


def storage_hung(directory: Path, timeout_s: float) -> str | None:
    """None when ``directory``'s storage answered a small write and fsync within ``timeout_s``
    (with success or an error); otherwise one line saying it did not."""
    probe = subprocess.Popen(
        [sys.executable, "-I", "-S", "-c", _PROBE, str(directory)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    try:
        probe.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        # Let go where the storage lets a killed caller go; never waited for (a probe in
        # uninterruptible sleep would hold this process too).
        probe.kill()
        return (
            f"the storage under {directory} does not answer: a write and fsync of a small file "
            f"got no reply in {timeout_s:g} s (a hung NFS/Lustre/FUSE mount?)"
        )
    return None
