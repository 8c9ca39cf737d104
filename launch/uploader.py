"""``launch local``'s uploader for ``checkpoint.remote``: the follower beside the job, kept
alive, and the final pass after it."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading

from launch.common import LaunchPlan, uploader_args
from pretrain.context import exit_codes

log = logging.getLogger(__name__)


class Uploader:
    """checkpoint.remote: ``python -m resiliency upload --follow`` beside the job, as its own
    process (it outlives a rank or launcher crash), restarted with backoff whenever it dies
    (except when the run's lease moved to another job, whose uploader takes over); then one
    final pass after the job. ``ok`` says whether that pass left the newest verified step
    committed remotely."""

    def __init__(self, plan: LaunchPlan) -> None:
        self.plan = plan
        self.follow = uploader_args(plan.run, plan.run_dir, follow=True)
        self.proc: subprocess.Popen[bytes] | None = None
        self.restarts = 0
        self.stopping = threading.Event()
        self.watcher = threading.Thread(target=self._watch, name="uploader-watch", daemon=True)

    def start(self) -> None:
        if self.follow is None:
            return
        log.info("launch local: uploader: %s", " ".join(self.follow))
        self._spawn()
        self.watcher.start()

    def _spawn(self) -> None:
        assert self.follow is not None
        self.proc = subprocess.Popen([sys.executable, *self.follow], start_new_session=True)

    def _watch(self) -> None:
        while not self.stopping.wait(1.0):
            assert self.proc is not None
            code = self.proc.poll()
            if code is None:
                continue
            if code == exit_codes.LEASE_HELD:
                log.warning("launch local: uploader exited %d: the run's lease moved to another "
                            "job; not restarted", code)  # fmt: skip
                return
            delay = min(60.0, 2.0**self.restarts)
            log.error("launch local: uploader exited %d; restarting it in %.0f s", code, delay)
            if self.stopping.wait(delay):
                return
            self.restarts += 1
            self._spawn()

    def finish(self, final_pass: bool = True) -> bool:
        """Stop the follower, run the final pass; True when the remote tier caught up.
        ``final_pass=False``: the run dir does not answer; the follower is killed and nothing
        waits on it (the object store keeps what it had sent)."""
        if self.follow is None:
            return True
        self.stopping.set()
        self.watcher.join(timeout=5)
        if not final_pass:
            if self.proc is not None:
                self.proc.kill()
            log.error("launch local: no final upload: the run dir does not answer")
            return False
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()  # finishes the object in flight; the final pass does the rest
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        final = uploader_args(self.plan.run, self.plan.run_dir, follow=False) or []
        code = subprocess.run([sys.executable, *final], check=False).returncode
        (log.info if code == 0 else log.error)(
            "launch local: final upload exited %d (uploader restarted %d times)%s",
            code,
            self.restarts,
            "" if code == 0 else ": the object store lacks the newest verified step",
        )
        return code == 0
