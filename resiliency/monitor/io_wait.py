"""Which file a thread is blocked on, read from /proc: the syscall it is in and the path it
names (the fd's target, or the path argument read from the process's own memory). A rank
stuck on a hung NFS or Lustre mount shows a Python stack inside ``open`` or ``read`` that
names no file; this names it. Never touches the file system it asks about: /proc/<pid>/fd
links and /proc/<pid>/mem are answered by the kernel from its own tables.

Also a process's threads and each thread's state, for those who look for the stuck one.

Linux only (x86_64 and aarch64 syscall numbers); None wherever it cannot tell.
"""

from __future__ import annotations

import os
import platform

# syscall number -> (name, which argument names the file: "fd" or "path" at index 1)
_X86_64 = {
    0: ("read", "fd"), 1: ("write", "fd"), 2: ("open", "path0"), 3: ("close", "fd"),
    4: ("stat", "path0"), 5: ("fstat", "fd"), 6: ("lstat", "path0"), 17: ("pread64", "fd"),
    18: ("pwrite64", "fd"), 19: ("readv", "fd"), 20: ("writev", "fd"), 74: ("fsync", "fd"),
    75: ("fdatasync", "fd"), 77: ("ftruncate", "fd"), 82: ("rename", "path0"),
    83: ("mkdir", "path0"), 87: ("unlink", "path0"), 217: ("getdents64", "fd"),
    257: ("openat", "path1"), 258: ("mkdirat", "path1"), 262: ("newfstatat", "path1"),
    263: ("unlinkat", "path1"), 264: ("renameat", "path1"), 277: ("sync_file_range", "fd"),
    285: ("fallocate", "fd"), 295: ("preadv", "fd"), 296: ("pwritev", "fd"),
    316: ("renameat2", "path1"), 332: ("statx", "path1"),
}  # fmt: skip
_AARCH64 = {
    34: ("mkdirat", "path1"), 35: ("unlinkat", "path1"), 38: ("renameat", "path1"),
    46: ("ftruncate", "fd"), 47: ("fallocate", "fd"), 56: ("openat", "path1"),
    57: ("close", "fd"), 61: ("getdents64", "fd"), 63: ("read", "fd"), 64: ("write", "fd"),
    65: ("readv", "fd"), 66: ("writev", "fd"), 67: ("pread64", "fd"), 68: ("pwrite64", "fd"),
    79: ("newfstatat", "path1"), 80: ("fstat", "fd"), 82: ("fsync", "fd"),
    83: ("fdatasync", "fd"), 84: ("sync_file_range", "fd"), 276: ("renameat2", "path1"),
    291: ("statx", "path1"),
}  # fmt: skip
SYSCALLS = {"x86_64": _X86_64, "aarch64": _AARCH64}.get(platform.machine(), {})
PATH_MAX = 600  # characters kept of a path (the record is a fixed-size slot)


def blocked_in(pid: int, tid: int) -> dict[str, str] | None:
    """{"syscall", "path"} of the file syscall thread ``tid`` of ``pid`` is in now, or None
    (running, in another syscall, or unreadable)."""
    try:
        with open(f"/proc/{pid}/task/{tid}/syscall") as f:
            fields = f.read().split()
    except OSError:
        return None
    if not fields or not fields[0].lstrip("-").isdigit():
        return None  # "running"
    known = SYSCALLS.get(int(fields[0]))
    if known is None or len(fields) < 3:
        return None
    name, where = known
    args = [int(a, 16) for a in fields[1:7]]
    path = _fd_path(pid, args[0]) if where == "fd" else _user_string(pid, args[int(where[-1])])
    if path is None:
        return None
    return {"syscall": name, "path": path[:PATH_MAX]}


def _fd_path(pid: int, fd: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/fd/{fd}")
    except OSError:
        return None


def _user_string(pid: int, address: int) -> str | None:
    """The NUL-terminated string at ``address`` in ``pid``'s memory (a path argument)."""
    try:
        with open(f"/proc/{pid}/mem", "rb") as mem:
            mem.seek(address)
            raw = mem.read(4096)
    except (OSError, OverflowError, ValueError):
        return None
    return raw.split(b"\0", 1)[0].decode(errors="replace") or None


def threads(pid: int) -> list[int]:
    """The thread ids of ``pid`` (empty once it is gone)."""
    try:
        return [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


def thread_state(pid: int, tid: int) -> str | None:
    """The kernel's one-letter state of a thread ("D": uninterruptible sleep), or None."""
    try:
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None
