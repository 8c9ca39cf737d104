"""Single-writer lease on a run dir, so two jobs never write (or GC) the same run at once.

LEASE holds the owner's identity and a heartbeat. Every read-decide-write of LEASE (acquire,
heartbeat, release) runs under a short mutex: LEASE.lock, hard-linked into place from a file
that already holds the owner's identity; link() of an existing name fails for all but one
process, also across hosts on a shared filesystem (the classic NFS-safe lock). The lock is never
seen without its owner, so a process killed while taking it leaves a lock whose dead pid marks
it stale at once (an O_EXCL create followed by a write leaves an empty one in between, which
only age can clear: a SIGSTOP there once cost a relaunch 30 s of setup).
Writing LEASE itself with os.replace alone would not do: two acquirers could both read "stale"
and both replace it, each believing it won.
"""

from __future__ import annotations

import json
import logging
import os
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import psutil

from pretrain import exit_codes
from pretrain.failures import ClassifiedError
from resiliency.storage.layout import RunLayout, atomic_write_json, fsync_dir

logger = logging.getLogger(__name__)

# The mutex is held for milliseconds; one older than this was left by a crashed process.
_LOCK_STALE_S = 30.0


class LeaseHeldError(ClassifiedError):
    """Another live owner holds the run's lease."""

    kind, exit_code = "lease", exit_codes.LEASE_HELD


class LeaseLostError(RuntimeError):
    """Our lease was taken over (we were presumed dead) or removed."""


def _pid_namespace() -> str | None:
    # Hostname alone does not say whether a pid is meaningful to us: containers with host
    # networking share the node's hostname, and a reboot reuses pids. Boot id + pid namespace do.
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return None


def _pid_start(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except (psutil.Error, OSError):
        return None


def _job_id() -> str | None:
    # TORCHELASTIC_RUN_ID is torchrun/ft_launcher's rendezvous id: stable across its restarts.
    for name in ("MCORE_RECIPES_JOB_ID", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID"):
        if os.environ.get(name):
            return os.environ[name]
    return None


@dataclass(frozen=True)
class LeaseInfo:
    attempt: int
    host: str
    pid: int
    heartbeat: float  # unix time
    job_id: str | None = None
    pid_ns: str | None = None
    pid_start: float | None = None
    acquired_at: float | None = None
    timeout_s: float | None = None  # the owner's own timeout, for tools that only observe

    @classmethod
    def from_dict(cls, d: Any) -> LeaseInfo:
        if not isinstance(d, dict):
            raise ValueError("lease is not a JSON object")
        try:
            return cls(
                int(d["attempt"]),
                str(d["host"]),
                int(d["pid"]),
                float(d["heartbeat"]),
                d.get("job_id"),
                d.get("pid_ns"),
                d.get("pid_start"),
                d.get("acquired_at"),
                d.get("timeout_s"),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"lease is missing or has a bad field: {e}") from e

    @classmethod
    def for_this_process(
        cls, attempt: int, timeout_s: float, acquired_at: float | None = None
    ) -> LeaseInfo:
        now = time.time()
        return cls(
            attempt,
            socket.gethostname(),
            os.getpid(),
            now,
            _job_id(),
            _pid_namespace(),
            _pid_start(os.getpid()),
            acquired_at or now,
            timeout_s,
        )

    def describe(self, now: float) -> str:
        job = f", job {self.job_id}" if self.job_id else ""
        return (
            f"attempt {self.attempt} on host {self.host} (pid {self.pid}{job}), "
            f"last heartbeat {now - self.heartbeat:.1f}s ago"
        )


def read_lease(layout: RunLayout) -> LeaseInfo | None:
    """Current lease, None if there is none; ValueError if LEASE is not a lease."""
    try:
        raw = layout.lease_path.read_text()
    except FileNotFoundError:
        return None
    try:
        return LeaseInfo.from_dict(json.loads(raw))
    except json.JSONDecodeError as e:
        raise ValueError(f"LEASE is not JSON: {e}") from e


def stale_reason(info: LeaseInfo, timeout_s: float, now: float | None = None) -> str | None:
    """Why ``info``'s owner is presumed dead, or None if it may still be alive."""
    now = time.time() if now is None else now
    age = now - info.heartbeat
    if age > timeout_s:
        return f"heartbeat {age:.1f}s old exceeds timeout {timeout_s:.0f}s"
    local_ns = _pid_namespace()
    if info.host != socket.gethostname() or local_ns is None or info.pid_ns != local_ns:
        return None
    if not psutil.pid_exists(info.pid):
        return f"owner pid {info.pid} is no longer running on this host"
    start = _pid_start(info.pid)
    if info.pid_start is not None and start is not None and abs(start - info.pid_start) > 1.0:
        return f"owner pid {info.pid} now belongs to another process"
    return None


def _lock_is_stale(lock: Path) -> bool:
    try:
        age = time.time() - lock.stat().st_mtime
        owner = json.loads(lock.read_text() or "null")
    except FileNotFoundError:
        return False
    except (OSError, json.JSONDecodeError):
        owner = None
    if age > _LOCK_STALE_S:
        return True
    if not isinstance(owner, dict):
        return False  # exclusive-create fallback: created, identity not written yet
    local = owner.get("pid_ns") == _pid_namespace() and owner.get("host") == socket.gethostname()
    pid = owner.get("pid")
    return local and isinstance(pid, int) and pid > 0 and not psutil.pid_exists(pid)


def _try_create_lock(lock: Path) -> bool:
    """Create `lock` holding our identity, atomically; False if it exists."""
    me = {"host": socket.gethostname(), "pid": os.getpid(), "pid_ns": _pid_namespace()}
    # Per thread: the heartbeat thread and the main thread may both take the mutex.
    who = f"{socket.gethostname()}.{os.getpid()}.{threading.get_ident()}"
    staged = lock.with_name(f"{lock.name}.{who}.tmp")
    staged.write_text(json.dumps(me))
    try:
        os.link(staged, lock)
        return True
    except FileExistsError:
        return False
    except OSError:
        # A filesystem without hard links (some FUSE object-store mounts): exclusive create,
        # with the empty-lock window the link avoids.
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(me))
        return True
    finally:
        staged.unlink(missing_ok=True)


@contextmanager
def _mutex(lease_path: Path, wait_s: float) -> Iterator[None]:
    lock = lease_path.with_name(lease_path.name + ".lock")
    deadline = time.monotonic() + wait_s
    while not _try_create_lock(lock):
        if _lock_is_stale(lock):
            # Tiny window: two breakers could both remove it; only reachable after a crash
            # inside the millisecond-long critical section.
            logger.warning("removing stale lease mutex %s", lock)
            lock.unlink(missing_ok=True)
            continue
        if time.monotonic() > deadline:
            raise LeaseHeldError(
                f"{lock} stayed locked for {wait_s:.0f}s; another process is "
                f"acquiring the lease (delete the file if none is)"
            ) from None
        time.sleep(random.uniform(0.005, 0.03))
    try:
        yield
    finally:
        lock.unlink(missing_ok=True)


class RunLease:
    """Exclusive right of one attempt to write a run; keep it alive with heartbeats."""

    def __init__(
        self, layout: RunLayout, attempt: int, timeout_s: float, lock_wait_s: float = 10.0
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.layout, self.attempt, self.timeout_s = layout, attempt, timeout_s
        self.lock_wait_s = lock_wait_s
        self.lost: LeaseLostError | None = None
        self._acquired_at: float | None = None
        self._stop: threading.Event | None = None
        self._thread: threading.Thread | None = None

    def _is_mine(self, info: LeaseInfo) -> bool:
        return (
            info.attempt == self.attempt
            and info.host == socket.gethostname()
            and info.pid == os.getpid()
        )

    def _write(self) -> None:
        info = LeaseInfo.for_this_process(self.attempt, self.timeout_s, self._acquired_at)
        atomic_write_json(self.layout.lease_path, asdict(info))

    def _current(self) -> LeaseInfo | None:
        try:
            return read_lease(self.layout)
        except ValueError as e:
            age = time.time() - self.layout.lease_path.stat().st_mtime
            if age > self.timeout_s:
                logger.warning("replacing unreadable LEASE (%s), last written %.0fs ago", e, age)
                return None
            raise LeaseHeldError(
                f"{self.layout.lease_path} is unreadable ({e}) and was written "
                f"{age:.0f}s ago; retry after {self.timeout_s:.0f}s"
            ) from e

    def acquire(self) -> None:
        self.layout.run_dir.mkdir(parents=True, exist_ok=True)
        with _mutex(self.layout.lease_path, self.lock_wait_s):
            current = self._current()
            if current is not None and not self._is_mine(current):
                self._check_takeover(current)
            self._acquired_at = time.time()
            self._write()
        self.lost = None
        logger.info("acquired lease on %s for attempt %d", self.layout.run_dir, self.attempt)

    def _check_takeover(self, current: LeaseInfo) -> None:
        now = time.time()
        reason = stale_reason(current, self.timeout_s, now)
        if reason is None and current.job_id is not None and current.job_id == _job_id():
            # A launcher restarts a worker group only after tearing the old one down; the new
            # rank 0 may sit on another host, where the dead owner's pid cannot be checked.
            reason = f"same job {current.job_id} restarted its worker group"
        if reason is None:
            raise LeaseHeldError(
                f"run {self.layout.run_dir} is held by {current.describe(now)}. Wait for that "
                f"job to finish or stop it. If it is dead, its lease is taken over once the "
                f"heartbeat is older than {self.timeout_s:.0f}s (immediately when the dead "
                f"process was on this host)."
            )
        logger.warning("taking over lease of %s: %s", current.describe(now), reason)

    def heartbeat(self) -> None:
        """Refresh our heartbeat; LeaseLostError if someone else owns the lease now."""
        with _mutex(self.layout.lease_path, min(self.lock_wait_s, self.timeout_s / 2)):
            current = self._current()
            if current is None or not self._is_mine(current):
                owner = current.describe(time.time()) if current else "nobody"
                raise LeaseLostError(f"lease on {self.layout.run_dir} lost: now held by {owner}")
            self._write()

    def release(self) -> None:
        self.stop_heartbeat()
        with _mutex(self.layout.lease_path, self.lock_wait_s):
            current = self._current()
            if current is None or not self._is_mine(current):
                logger.warning("not releasing lease on %s: not ours", self.layout.run_dir)
                return
            self.layout.lease_path.unlink()
            fsync_dir(self.layout.run_dir)
        logger.info("released lease on %s", self.layout.run_dir)

    def start_heartbeat(
        self,
        interval_s: float | None = None,
        on_lost: Callable[[LeaseLostError], None] | None = None,
    ) -> None:
        interval = interval_s if interval_s is not None else self.timeout_s / 4
        if interval >= self.timeout_s:
            raise ValueError(f"heartbeat interval {interval}s must be < timeout {self.timeout_s}s")
        self.stop_heartbeat()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._beat_loop,
            args=(self._stop, interval, on_lost),
            name="run-lease-heartbeat",
            daemon=True,
        )
        self._thread.start()

    def _beat_loop(
        self,
        stop: threading.Event,
        interval: float,
        on_lost: Callable[[LeaseLostError], None] | None,
    ) -> None:
        while not stop.wait(interval):
            try:
                self.heartbeat()
            except LeaseLostError as e:
                logger.error("%s", e)
                self.lost = e
                if on_lost is not None:
                    on_lost(e)
                return
            except (OSError, LeaseHeldError) as e:
                # Transient (slow shared FS, contended mutex): the next beat retries.
                logger.warning("lease heartbeat failed, will retry: %s", e)

    def stop_heartbeat(self) -> None:
        if self._stop is not None and self._thread is not None:
            self._stop.set()
            if self._thread is not threading.current_thread():
                self._thread.join()
        self._stop = self._thread = None

    def __enter__(self) -> RunLease:
        self.acquire()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()
