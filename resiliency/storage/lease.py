"""Single-writer lease on a run dir, fenced by generation, judged without comparing clocks.

LEASE holds the owner's identity, a **generation** that grows with every acquisition (kept in
LEASE.generation too, so a released lease does not reset it) and a heartbeat **counter**.
Every write that changes what a restore would see (publishing a step, moving latest.json,
retention deletes) runs inside :meth:`RunLease.hold`: under the lease mutex, LEASE must still
name this owner and generation, else nothing is written and :class:`LeaseLostError` (exit 6)
names the new owner. A stale owner woken from a stall (SIGSTOP, GC pause, hung NFS, partition)
therefore cannot publish over its successor.

Staleness never compares two hosts' clocks: an owner is presumed dead when its heartbeat counter
has not moved for ``timeout_s`` as measured by the observer's own monotonic clock while it
watches (the first look starts the watch), or at once when it is provably dead (same host and
pid namespace, process gone). An owner provably alive (same host and namespace, pid running,
even if stopped) is never taken over. The mutex's staleness is judged the same way.

The mutex is LEASE.lock, hard-linked into place from a file that already holds the owner's
identity; link() of an existing name fails for all but one process, also across hosts on a
shared filesystem (the classic NFS-safe lock), and the lock is never seen without its owner.
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

from pretrain.context import exit_codes
from pretrain.context.failures import ClassifiedError
from pretrain.platform.host import boot_and_pid_namespace
from resiliency.storage.layout import RunLayout, atomic_write_json, fsync_dir

logger = logging.getLogger(__name__)

# The mutex is held for milliseconds; one unchanged this long (by our clock) was left by a
# crashed process.
_LOCK_STALE_S = 30.0


class LeaseHeldError(ClassifiedError):
    """Another live owner holds the run's lease."""

    kind, exit_code = "lease", exit_codes.LEASE_HELD


class LeaseLostError(ClassifiedError):
    """Our lease was taken over (we were presumed dead) or removed: this attempt is fenced
    and writes nothing more that a restore would see."""

    kind, exit_code = "lease", exit_codes.LEASE_HELD


def _pid_start(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except (psutil.Error, OSError):
        return None


def _is_zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except (psutil.Error, OSError):
        return False


def _job_id() -> str | None:
    # TORCHELASTIC_RUN_ID is torchrun/ft_launcher's rendezvous id: stable across its restarts.
    for name in ("MCORE_RECIPES_JOB_ID", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID"):
        if os.environ.get(name):
            return os.environ[name]
    return None


def process_identity() -> dict[str, Any]:
    """Who this process is, in the terms :func:`owner_liveness` judges (attempt records)."""
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "pid_ns": boot_and_pid_namespace(),
        "pid_start": _pid_start(os.getpid()),
    }


def owner_liveness(
    host: Any, pid: Any, pid_ns: Any, pid_start: Any = None
) -> tuple[bool | None, str]:
    """(True: provably alive, False: provably dead, None: cannot tell from here; why).
    Only a process on this host in this pid namespace can be judged; a stopped one is alive."""
    local_ns = boot_and_pid_namespace()
    if host != socket.gethostname() or local_ns is None or pid_ns != local_ns:
        return None, "on another host or pid namespace"
    if not isinstance(pid, int) or pid <= 0 or not psutil.pid_exists(pid):
        return False, f"owner pid {pid} is no longer running on this host"
    if _is_zombie(pid):  # exited, not yet reaped (a container whose init reaps nothing)
        return False, f"owner pid {pid} has exited (not yet reaped)"
    start = _pid_start(pid)
    if pid_start is not None and start is not None and abs(start - float(pid_start)) > 1.0:
        return False, f"owner pid {pid} now belongs to another process"
    return True, f"owner pid {pid} is running on this host"


@dataclass(frozen=True)
class LeaseInfo:
    attempt: int
    host: str
    pid: int
    heartbeat: float  # unix time of the last beat: shown to people, never compared
    job_id: str | None = None
    pid_ns: str | None = None
    pid_start: float | None = None
    acquired_at: float | None = None
    timeout_s: float | None = None  # the owner's own timeout, for tools that only observe
    generation: int = 0  # grows with every acquisition of the run's lease
    beats: int = 0  # heartbeat counter: an observer watches it move by its own clock

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
                int(d.get("generation", 0)),
                int(d.get("beats", 0)),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"lease is missing or has a bad field: {e}") from e

    @classmethod
    def for_this_process(
        cls,
        attempt: int,
        timeout_s: float,
        acquired_at: float | None = None,
        generation: int = 0,
        beats: int = 0,
    ) -> LeaseInfo:
        me = process_identity()
        now = time.time()
        return cls(
            attempt,
            me["host"],
            me["pid"],
            now,
            _job_id(),
            me["pid_ns"],
            me["pid_start"],
            acquired_at or now,
            timeout_s,
            generation,
            beats,
        )

    @property
    def watch_key(self) -> tuple[Any, ...]:
        """What must stay the same for the owner to look silent: who it is, and its count."""
        return (self.attempt, self.host, self.pid, self.generation, self.beats)

    def describe(self, now: float | None = None) -> str:
        job = f", job {self.job_id}" if self.job_id else ""
        return (
            f"attempt {self.attempt} on host {self.host} (pid {self.pid}{job}), "
            f"lease generation {self.generation}, {self.beats} heartbeats"
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


class SilenceWatch:
    """How long a value has stayed the same, by this process's monotonic clock: the first
    look starts the watch, a change restarts it. Thread-safe; one per observed file."""

    def __init__(self) -> None:
        self._seen: dict[str, tuple[Any, float]] = {}
        self._lock = threading.Lock()

    def silent_for(self, name: str, value: Any) -> float:
        now = time.monotonic()
        with self._lock:
            seen = self._seen.get(name)
            if seen is None or seen[0] != value:
                self._seen[name] = (value, now)
                return 0.0
            return now - seen[1]


_WATCH = SilenceWatch()


def stale_reason(
    info: LeaseInfo, timeout_s: float, watch: SilenceWatch | None = None, name: str = ""
) -> str | None:
    """Why ``info``'s owner is presumed dead, or None if it may still be alive. Without a
    ``watch`` (one look, e.g. ``ls``) only a provably dead owner is stale."""
    alive, why = owner_liveness(info.host, info.pid, info.pid_ns, info.pid_start)
    if alive is False:
        return why
    if alive or watch is None:
        return None
    silent = watch.silent_for(f"lease:{name}", info.watch_key)
    if silent >= timeout_s:
        return (
            f"its heartbeat counter stayed at {info.beats} for {silent:.1f}s by this "
            f"host's clock (timeout {timeout_s:.0f}s)"
        )
    return None


def _lock_is_stale(lock: Path) -> bool:
    try:
        st = lock.stat()
        raw = lock.read_text()
    except FileNotFoundError:
        return False
    except OSError:
        raw, st = "", None
    try:
        owner = json.loads(raw or "null")
    except json.JSONDecodeError:
        owner = None
    if isinstance(owner, dict):
        alive, _ = owner_liveness(owner.get("host"), owner.get("pid"), owner.get("pid_ns"))
        if alive is False:
            return True
    identity = (getattr(st, "st_ino", None), getattr(st, "st_dev", None), raw)
    return _WATCH.silent_for(f"lock:{lock}", identity) >= _LOCK_STALE_S


def _try_create_lock(lock: Path) -> bool:
    """Create `lock` holding our identity, atomically; False if it exists."""
    me = process_identity()
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
                f"{lock} stayed locked for {wait_s:.0f}s; another process is acquiring the "
                f"lease (it is removed once unchanged for {_LOCK_STALE_S:.0f}s, or at once "
                "when its owner is provably dead)"
            ) from None
        time.sleep(random.uniform(0.005, 0.03))
    try:
        yield
    finally:
        lock.unlink(missing_ok=True)


def _read_generation(path: Path) -> int:
    try:
        return int(json.loads(path.read_text())["generation"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


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
        self.generation = 0  # ours, once acquired
        self._beats = 0
        self._acquired_at: float | None = None
        self._stop: threading.Event | None = None
        self._thread: threading.Thread | None = None

    def _is_mine(self, info: LeaseInfo) -> bool:
        return (
            info.attempt == self.attempt
            and info.host == socket.gethostname()
            and info.pid == os.getpid()
            and info.generation == self.generation
        )

    def _write(self) -> None:
        info = LeaseInfo.for_this_process(
            self.attempt, self.timeout_s, self._acquired_at, self.generation, self._beats
        )
        atomic_write_json(self.layout.lease_path, asdict(info))

    def _current(self) -> tuple[LeaseInfo | None, str | None]:
        """(LEASE, None), or (None, why it may be replaced) for an unreadable one that stayed
        unchanged for the timeout by our clock; LeaseHeldError while it has not."""
        try:
            return read_lease(self.layout), None
        except ValueError as e:
            try:
                raw = self.layout.lease_path.read_bytes()
            except FileNotFoundError:
                return None, None
            silent = _WATCH.silent_for(f"garbage:{self.layout.lease_path}", raw)
            if silent >= self.timeout_s:
                return None, f"unreadable LEASE ({e}) unchanged for {silent:.0f}s"
            raise _Watching(f"{self.layout.lease_path} is unreadable ({e})") from e

    def acquire(self) -> None:
        """Take the run's lease: at once when it is free, ours, or its owner provably dead;
        after watching it stay silent for ``timeout_s`` when the owner cannot be judged from
        here; LeaseHeldError as soon as the owner is seen alive."""
        self.layout.run_dir.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + self.timeout_s + max(1.0, self.timeout_s / 4)
        waited = False
        while True:
            try:
                if self._try_acquire(waited):
                    break
            except _Watching as watching:
                if time.monotonic() > deadline:
                    raise LeaseHeldError(f"{watching}; retry later") from None
            if not waited:
                logger.warning(
                    "run %s is leased by an owner this host cannot check; watching its "
                    "heartbeat for up to %.0fs before taking over",
                    self.layout.run_dir,
                    self.timeout_s,
                )
            waited = True
            time.sleep(min(1.0, self.timeout_s / 8))
        self.lost = None
        logger.info(
            "acquired lease on %s for attempt %d (generation %d)",
            self.layout.run_dir,
            self.attempt,
            self.generation,
        )

    def _try_acquire(self, watched: bool) -> bool:
        with _mutex(self.layout.lease_path, max(self.lock_wait_s, _LOCK_STALE_S + 5)):
            current, garbage = self._current()
            if current is not None and not self._is_mine(current):
                if not self._may_take_over(current, watched):
                    return False
            elif garbage:
                logger.warning("replacing %s", garbage)
            last = max(
                _read_generation(self.layout.lease_generation_path),
                current.generation if current else 0,
            )
            self.generation, self._beats = last + 1, 0
            self._acquired_at = time.time()
            # The counter first: a crash between the two writes skips a number, never reuses one.
            atomic_write_json(self.layout.lease_generation_path, {"generation": self.generation})
            self._write()
        return True

    def _may_take_over(self, current: LeaseInfo, watched: bool) -> bool:
        """True: presumed dead (logged); False: keep watching; LeaseHeldError: alive."""
        first_look = _WATCH.silent_for(f"lease:{self.layout.lease_path}", current.watch_key)
        reason = stale_reason(current, self.timeout_s, _WATCH, str(self.layout.lease_path))
        if reason is not None:
            logger.warning("taking over lease of %s: %s", current.describe(), reason)
            return True
        alive, why = owner_liveness(current.host, current.pid, current.pid_ns, current.pid_start)
        if alive or (watched and first_look == 0.0):
            seen = why if alive else "its heartbeat counter moved while this host watched"
            raise LeaseHeldError(
                f"run {self.layout.run_dir} is held by {current.describe()}: {seen}. Wait for "
                f"that job to finish or stop it. A dead owner's lease is taken over once its "
                f"heartbeat has not moved for {self.timeout_s:.0f}s (at once when the dead "
                f"process was on this host)."
            )
        return False

    def hold(self, what: str) -> Any:
        """Context manager: ``what`` (a write a restore would see) runs under the lease mutex
        and only while LEASE still names this owner and generation; else LeaseLostError and
        nothing is written."""
        return self._holding(what)

    @contextmanager
    def _holding(self, what: str) -> Iterator[None]:
        with _mutex(self.layout.lease_path, max(self.lock_wait_s, _LOCK_STALE_S + 5)):
            self._check_still_mine(what)
            yield

    def _check_still_mine(self, what: str) -> None:
        try:
            current, _ = self._current()
        except _Watching:
            current = None
        if current is None or not self._is_mine(current):
            owner = current.describe() if current else "nobody"
            lost = LeaseLostError(
                f"lease on {self.layout.run_dir} lost: now held by {owner}; attempt "
                f"{self.attempt} (generation {self.generation}) is fenced: {what} refused"
            )
            self.lost = self.lost or lost
            raise lost

    def heartbeat(self) -> None:
        """Count one beat; LeaseLostError if someone else owns the lease now."""
        with _mutex(self.layout.lease_path, min(self.lock_wait_s, self.timeout_s / 2)):
            self._check_still_mine("heartbeat")
            self._beats += 1
            self._write()

    def release(self) -> None:
        self.stop_heartbeat()
        with _mutex(self.layout.lease_path, self.lock_wait_s):
            try:
                current, _ = self._current()
            except _Watching:
                current = None
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


class _Watching(Exception):
    """The lease (or an unreadable LEASE) may still be alive: keep watching it."""


class GenerationPin:
    """For a process that serves one job's lease without holding it (the remote uploader):
    the generation it first sees is the job's; once LEASE names another generation, that job
    was fenced and so is this process's deleting."""

    def __init__(self, layout: RunLayout) -> None:
        self.layout = layout
        self.generation: int | None = None

    def problem(self) -> str | None:
        """Why this process may no longer delete, or None."""
        try:
            info = read_lease(self.layout)
        except ValueError as e:
            return f"LEASE is unreadable ({e}): not deleting until it is"
        if info is None:
            return None  # the job released it: nobody else writes
        if self.generation is None:
            self.generation = info.generation
        if info.generation != self.generation:
            return (
                f"the run's lease moved from generation {self.generation} to "
                f"{info.generation} ({info.describe()}): the job this process served was fenced"
            )
        return None
