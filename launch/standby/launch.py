"""Starting and stopping a node's standby server beside the launcher (local, pod; the Slurm
script starts its own in each node's launcher task)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

from launch.standby import protocol

log = logging.getLogger(__name__)
THREAD_ENV = "OMP_NUM_THREADS"


def standby_env(run_dir: Path) -> dict[str, str]:
    """What the launcher's workers and the standby share: the standby's name, and
    OMP_NUM_THREADS (1 unless set, as torchrun sets it for several ranks) so that the standby
    imports torch with the thread pools the workers use."""
    return {
        protocol.SOCKET_ENV: protocol.address(run_dir),
        THREAD_ENV: os.environ.get(THREAD_ENV, "1"),
    }


class Standby:
    """``python -m launch.standby.server RUN_DIR`` for this node, in its own session (a
    Ctrl-C reaches the launcher, which stops the workers); it ends with this process."""

    def __init__(self, run_dir: Path) -> None:
        cmd = [sys.executable, "-m", "launch.standby.server", str(run_dir)]
        log.info("launch: standby server: %s", " ".join(cmd))
        env = {**os.environ, **standby_env(run_dir)}
        self.proc = subprocess.Popen(cmd, env=env, start_new_session=True)

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.proc.poll() is not None:
            log.warning("launch: the standby server had exited (%d)", self.proc.returncode)
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()  # not waited for: one stuck on a hung mount would hold the launch
