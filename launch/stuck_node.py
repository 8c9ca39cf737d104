"""A node the launcher cannot stop cleanly: ranks that outlive SIGKILL (uninterruptible sleep in
a hung NFS/Lustre/FUSE mount, or in a driver) or a run dir whose storage stops answering.

torch elastic stops a failed group by signalling its workers and then *joining* them, without
a limit: one rank in uninterruptible sleep holds ft_launcher (and whoever waits for it) until
the storage answers, minutes or never. :class:`StuckWatch` runs beside ``launch local``'s
launcher. From the moment the launcher reports a failure (a rank monitor's timeout, a failed
worker group) it asks the storage whether it answers (:mod:`resiliency.monitor.storage_probe`)
and gives the launcher ``stop_deadline_s`` to stop the ranks that were running then. A storage
that does not answer, or ranks still there at the deadline that also outlive a SIGKILL of
their own, make a :class:`NodeVerdict`: ``launch local`` names each process (rank, pid, state,
the syscall and file it is blocked in), kills the launcher, writes nothing to the run dir and
exits ``NODE_UNHEALTHY`` (14): drain the node, resume elsewhere.

The attempt's record is written later, once the storage answers (:mod:`launch.deferred_record`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from launch.processes import rank_workers
from resiliency.monitor.io_wait import blocked_in, thread_state, threads
from resiliency.monitor.postmortem import LauncherEvents
from resiliency.monitor.storage_probe import storage_hung

log = logging.getLogger(__name__)
KILL_GRACE_S = 5.0  # a SIGKILLed process not gone by then is not going
POLL_S = 0.5


@dataclass
class NodeVerdict:
    """Why this node was given up on: the storage probe's line and/or the processes that
    outlived SIGKILL."""

    storage: str | None
    unkillable: list[dict[str, Any]]
    at: float

    def lines(self) -> list[str]:
        said = [self.storage] if self.storage else []
        for proc in self.unkillable:
            where = (
                f"blocked in {proc['syscall']}({proc['path']})" if proc.get("syscall") else
                "not in a file call /proc can name"
            )  # fmt: skip
            said.append(f"rank {proc['rank']} (pid {proc['pid']}) outlived SIGKILL: "
                        f"{proc['state']}, {where}")  # fmt: skip
        return said


def describe(rank: int, proc: psutil.Process) -> dict[str, Any]:
    """rank, pid, state and the file call a stuck thread of ``proc`` is in (the first thread in
    uninterruptible sleep, else the main thread)."""
    found: dict[str, Any] = {"rank": rank, "pid": proc.pid, "state": "gone"}
    try:
        found["state"] = proc.status()
    except psutil.Error:
        return found
    stuck = [t for t in threads(proc.pid) if thread_state(proc.pid, t) == "D"]
    for tid in [*stuck, proc.pid]:
        if (call := blocked_in(proc.pid, tid)) is not None:
            return {**found, **call}
    return found


def alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def kill_and_survivors(
    procs: dict[int, psutil.Process], grace_s: float = KILL_GRACE_S
) -> dict[int, psutil.Process]:
    """SIGKILL each; those still there after ``grace_s``."""
    for proc in procs.values():
        try:
            proc.kill()
        except psutil.Error:
            pass
    deadline = time.monotonic() + grace_s
    while (left := {r: p for r, p in procs.items() if alive(p)}) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


class StuckWatch(threading.Thread):
    """Judges each failure the launcher reports (see the module's doc); ``on_verdict`` is
    called once, from this thread, when the node is given up on. ``quiet()``: a stop the
    user or the scheduler asked for is under way (the ranks are saving; not judged)."""

    def __init__(
        self,
        run_dir: Path,
        events: LauncherEvents,
        probe_timeout_s: float,
        stop_deadline_s: float,
        on_verdict: Callable[[NodeVerdict], None],
        quiet: Callable[[], bool],
    ) -> None:
        super().__init__(name="stuck-watch", daemon=True)
        self.run_dir, self.events = run_dir, events
        self.probe_timeout_s, self.stop_deadline_s = probe_timeout_s, stop_deadline_s
        self.on_verdict, self.quiet = on_verdict, quiet
        self.stopping = threading.Event()

    def run(self) -> None:
        judged = None
        while not self.stopping.wait(POLL_S):
            failed_at = self._failure_since_last_start()
            if failed_at is None or failed_at == judged or self.quiet():
                continue
            judged = failed_at
            verdict = self._judge(failed_at)
            if verdict is not None and not self.stopping.is_set():  # not after the launch ended
                self.on_verdict(verdict)
                return

    def stop(self) -> None:
        self.stopping.set()

    def _failure_since_last_start(self) -> float | None:
        started = self.events.joins[-1] if self.events.joins else 0.0
        times = [t for t in self.events.detections if t >= started]
        times += [m["time"] for m in self.events.monitor_timeouts if m["time"] >= started]
        return min(times) if times else None

    def _judge(self, failed_at: float) -> NodeVerdict | None:
        # The ranks of the failed round: a rank started after the failure is the restart's.
        ranks = rank_workers(self.run_dir)
        workers = {r: p for r, p in ranks.items() if _started_before(p, failed_at)}
        hung = storage_hung(self.run_dir, self.probe_timeout_s)
        if hung is None:
            deadline = failed_at + self.stop_deadline_s
            while any(alive(p) for p in workers.values()) and time.time() < deadline:
                if self.stopping.wait(POLL_S):
                    return None
            workers = {r: p for r, p in workers.items() if alive(p)}
            if not workers:
                return None  # the launcher stopped them: its own restart or exit follows
            log.error("launch local: rank(s) %s still running %.0f s after the launcher saw the "
                      "failure: killing them", sorted(workers), self.stop_deadline_s)  # fmt: skip
        left = kill_and_survivors(workers)
        if hung is None and not left:
            return None
        return NodeVerdict(hung, [describe(r, p) for r, p in sorted(left.items())], time.time())


def _started_before(proc: psutil.Process, at: float) -> bool:
    try:
        return proc.create_time() <= at
    except psutil.Error:
        return False
