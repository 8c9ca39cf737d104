"""A file system that fails and hangs on demand: a FUSE passthrough (mfusepy on libfuse3) of a
backing directory, whose calls on chosen paths return EIO, ESTALE or ENOSPC, or block until
released, as a rules file says, rewritten while the code under test runs. The faults come
from the kernel's file system layer, where a stuck NFS client's or a failing disk's do: the
trainer, its writers, the launcher and every other process meet them in their own syscalls.

    python -m drill.faultfs BACKING MOUNTPOINT --rules RULES.json [--hits HITS.jsonl]

RULES.json is a list of rules, re-read whenever it changes:

    [{"op": "read", "path": "steps/step-*/model/*.distcp", "error": "EIO", "times": 1}]

``op``: getattr, readdir, open, create, read, write, fsync, flush, release, unlink, rename,
mkdir, statfs, or ``*`` (any); ``path``: a glob on the path relative to the mount (``*``
crosses ``/``); ``error``: EIO, ESTALE, ENOSPC, EACCES, or ``block`` (the call waits until no
block rule matches it any more: a hung mount, released by rewriting the rules); ``times``:
how many calls the rule hits (absent: every one); ``unkillable``: a blocked call ignores
the kernel's interrupt when its caller is SIGKILLed (a process stuck in uninterruptible sleep;
by default a killed caller is let go, as a hung NFS hard mount lets a SIGKILLed process go).
Each hit is appended to HITS.jsonl (op, path, error, pid of the caller, time) outside the
mount, so a test can confirm where a fault landed from the file system's own record. Checkpoint
files bypass the page cache (``--direct-io``), so every read asks the rules. Needs root (or
fuse permissions), /dev/fuse and libfuse3.
"""

from __future__ import annotations

import argparse
import errno
import fnmatch
import json
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
ERRORS = {"EIO": errno.EIO, "ESTALE": errno.ESTALE, "ENOSPC": errno.ENOSPC, "EACCES": errno.EACCES}
BLOCK = "block"
POLL_S = 0.05  # a blocked call re-reads the rules this often


@dataclass
class Rule:
    op: str
    path: str
    error: str
    times: int | None = None
    unkillable: bool = False  # block: ignore the kernel's interrupt (a process stuck in D state)

    def matches(self, op: str, rel: str) -> bool:
        return (self.op in ("*", op)) and fnmatch.fnmatchcase(rel, self.path)


def load_rules(text: str) -> list[Rule]:
    """Rules from the file's text; a bad rule raises ValueError naming it."""
    rules = []
    for raw in json.loads(text or "[]"):
        rule = Rule(
            raw["op"], raw["path"], raw["error"], raw.get("times"), raw.get("unkillable", False)
        )
        if rule.error not in ERRORS and rule.error != BLOCK:
            raise ValueError(f"rule {raw}: error must be one of {[*ERRORS, BLOCK]}")
        rules.append(rule)
    return rules


class Faults:
    """The rules file, re-read when it changes, and what each rule has hit so far."""

    def __init__(self, rules_path: Path, hits_path: Path | None) -> None:
        self.rules_path, self.hits_path = rules_path, hits_path
        self._stamp: tuple[int, int] | None = None
        self._rules: list[Rule] = []
        self._used: dict[int, int] = {}  # rule index -> hits (reset when the file changes)
        self._lock = threading.Lock()

    def _current(self) -> list[Rule]:
        try:
            st = self.rules_path.stat()
            stamp = (st.st_mtime_ns, st.st_size)
        except FileNotFoundError:
            stamp = None
        if stamp != self._stamp:
            try:
                text = self.rules_path.read_text() if stamp else "[]"
                self._rules, self._used, self._stamp = load_rules(text), {}, stamp
            except (OSError, ValueError, KeyError) as exc:  # half-written: keep the old rules
                log.warning("faultfs: rules not reloaded: %s", exc)
        return self._rules

    def check(self, op: str, rel: str) -> None:
        """Raise the error a rule gives this call, or block while a block rule matches it."""
        blocked = False
        while True:
            with self._lock:
                hit = self._match(op, rel, count=not blocked)
            if hit is None:
                return
            if hit.error != BLOCK:
                self._record(op, rel, hit.error)
                raise OSError(ERRORS[hit.error], os.strerror(ERRORS[hit.error]), rel)
            if not blocked:
                self._record(op, rel, BLOCK)
                blocked = True
            if not hit.unkillable and _interrupted():
                # The caller got a fatal signal (SIGKILL): the kernel asks the request to end,
                # as a hung NFS mount lets a killed process go (TASK_KILLABLE).
                raise OSError(errno.EINTR, os.strerror(errno.EINTR), rel)
            time.sleep(POLL_S)

    def _match(self, op: str, rel: str, count: bool) -> Rule | None:
        for index, rule in enumerate(self._current()):
            if not rule.matches(op, rel):
                continue
            used = self._used.get(index, 0)
            if rule.times is not None and used >= rule.times and count:
                continue
            if count:
                self._used[index] = used + 1
            return rule
        return None

    def _record(self, op: str, rel: str, error: str) -> None:
        if self.hits_path is None:
            return
        from mfusepy import fuse_get_context

        pid = fuse_get_context()[2]
        line = json.dumps({"op": op, "path": rel, "error": error, "pid": pid, "time": time.time()})
        with open(self.hits_path, "a") as out:
            out.write(line + "\n")


def _interrupted() -> bool:
    """libfuse's word that the request this thread serves was interrupted (``-o intr``)."""
    import mfusepy

    return bool(mfusepy._libfuse.fuse_interrupted())


def operations(backing: Path, faults: Faults, direct_io: str) -> Any:
    """A passthrough of ``backing`` (mfusepy Operations, raw file infos) that asks ``faults``
    first; files matching the glob ``direct_io`` bypass the page cache."""
    import mfusepy

    root = str(backing.resolve())

    def real(path: str) -> str:
        return root + path

    def rel(path: str) -> str:
        return path.lstrip("/")

    def fd(fi: Any) -> int:
        return fi.fh if hasattr(fi, "fh") else int(fi)

    def opened(fi: Any, path: str, handle: int) -> int:
        fi.fh = handle
        fi.direct_io = int(fnmatch.fnmatchcase(rel(path), direct_io))
        return 0

    class FaultOps(mfusepy.Operations):
        use_ns = True

        def getattr(self, path: str, fh: Any = None) -> dict[str, Any]:
            faults.check("getattr", rel(path))
            st = os.lstat(real(path))
            keys = ("st_mode", "st_nlink", "st_uid", "st_gid", "st_size", "st_ino", "st_dev")
            out = {k: getattr(st, k) for k in keys}
            out.update(st_atime=st.st_atime_ns, st_mtime=st.st_mtime_ns, st_ctime=st.st_ctime_ns)
            return out

        def readdir(self, path: str, fh: Any) -> list[str]:
            faults.check("readdir", rel(path))
            return [".", "..", *os.listdir(real(path))]

        def access(self, path: str, amode: int) -> int:
            if not os.access(real(path), amode):
                raise OSError(errno.EACCES, "access", path)
            return 0

        def open(self, path: str, fi: Any) -> int:
            faults.check("open", rel(path))
            return opened(fi, path, os.open(real(path), fi.flags))

        def create(self, path: str, mode: int, fi: Any = None) -> int:
            faults.check("create", rel(path))
            flags = (fi.flags if fi is not None else os.O_WRONLY) | os.O_CREAT
            return opened(fi, path, os.open(real(path), flags, mode))

        def read(self, path: str, size: int, offset: int, fh: Any) -> bytes:
            faults.check("read", rel(path))
            return os.pread(fd(fh), size, offset)

        def write(self, path: str, data: bytes, offset: int, fh: Any) -> int:
            faults.check("write", rel(path))
            return os.pwrite(fd(fh), data, offset)

        def fsync(self, path: str, datasync: int, fh: Any) -> int:
            faults.check("fsync", rel(path))
            (os.fdatasync if datasync else os.fsync)(fd(fh))
            return 0

        def fsyncdir(self, path: str, datasync: int, fh: Any) -> int:
            faults.check("fsync", rel(path))
            return 0

        def flush(self, path: str, fh: Any) -> int:
            faults.check("flush", rel(path))
            return 0

        def release(self, path: str, fh: Any) -> int:
            os.close(fd(fh))
            return 0

        def truncate(self, path: str, length: int, fh: Any = None) -> int:
            faults.check("write", rel(path))
            os.truncate(real(path), length)
            return 0

        def unlink(self, path: str) -> int:
            faults.check("unlink", rel(path))
            os.unlink(real(path))
            return 0

        def rename(self, old: str, new: str) -> int:
            faults.check("rename", rel(old))
            os.rename(real(old), real(new))
            return 0

        def mkdir(self, path: str, mode: int) -> int:
            faults.check("mkdir", rel(path))
            os.mkdir(real(path), mode)
            return 0

        def rmdir(self, path: str) -> int:
            faults.check("unlink", rel(path))
            os.rmdir(real(path))
            return 0

        def chmod(self, path: str, mode: int) -> int:
            os.chmod(real(path), mode)
            return 0

        def chown(self, path: str, uid: int, gid: int) -> int:
            os.chown(real(path), uid, gid)
            return 0

        def utimens(self, path: str, times: tuple[int, int] | None = None) -> int:
            os.utime(real(path), ns=times)
            return 0

        def link(self, target: str, source: str) -> int:
            os.link(real(source), real(target))
            return 0

        def symlink(self, target: str, source: str) -> int:
            os.symlink(source, real(target))
            return 0

        def readlink(self, path: str) -> str:
            return os.readlink(real(path))

        def statfs(self, path: str) -> dict[str, int]:
            faults.check("statfs", rel(path))
            st = os.statvfs(real(path))
            keys = ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree",
                    "f_files", "f_flag", "f_frsize", "f_namemax")  # fmt: skip
            return {k: getattr(st, k) for k in keys}

    return FaultOps()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m drill.faultfs", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("backing", type=Path, help="the directory the mount passes through to")
    parser.add_argument("mountpoint", type=Path)
    parser.add_argument("--rules", type=Path, required=True, help="JSON rules, re-read on change")
    parser.add_argument("--hits", type=Path, help="JSON lines: each fault as it lands")
    parser.add_argument(
        "--direct-io",
        default="*steps/*",
        help="glob of the files whose reads and writes bypass the page cache, so each one "
        "reaches the rules as a request of its caller (default: checkpoint steps); a cached "
        "file's blocked readahead holds its pages locked, and whoever touches them sleeps "
        "uninterruptibly. Mapped files (a dataset index) need the page cache",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="faultfs: %(message)s")
    try:
        import mfusepy
    except (ImportError, OSError) as exc:  # no wheel, or no libfuse on this host
        print(f"faultfs: {exc}; install mfusepy and libfuse3 (apt install fuse3)", file=sys.stderr)
        return 2
    if args.rules.exists():  # a typo in a rule is one line now, not a warning per call later
        try:
            load_rules(args.rules.read_text())
        except (ValueError, KeyError, TypeError) as exc:
            print(f"faultfs: {args.rules}: {exc!r}", file=sys.stderr)
            return 2
    args.mountpoint.mkdir(parents=True, exist_ok=True)
    faults = Faults(args.rules, args.hits)
    # Threads: a blocked call must not hold up the others (a hung NFS server hangs what asks
    # it; the rest of the machine goes on). default_permissions: root-owned files stay so.
    # intr: a request whose caller is killed is interrupted (SIGUSR1 to the serving thread), so
    # a block rule lets a SIGKILLed process go unless it says unkillable.
    # libfuse interrupts a killed caller's request with SIGUSR1 to the thread serving it, but
    # installs its handler only when the option is set before mounting, and mfusepy sets it
    # later: without a handler the signal would end this process.
    signal.signal(signal.SIGUSR1, lambda signum, frame: None)
    try:
        mfusepy.FUSE(operations(args.backing, faults, args.direct_io), str(args.mountpoint),
                     raw_fi=True, foreground=True, nothreads=False, allow_other=True,
                     default_permissions=True, intr=True)  # fmt: skip
    except RuntimeError as exc:  # libfuse's loop ended on a signal (Ctrl-C, SIGTERM): unmounted
        print(f"faultfs: {args.mountpoint} unmounted (libfuse returned {exc})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
