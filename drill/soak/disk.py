"""A file system of the soak run's own, for the ``full_disk`` fault.

Filling the disk a run shares with the machine would break everything else on it (and a large
disk takes long to fill), so the soak mounts a size-limited tmpfs at the soak run's output dir:
a few times what the clean run wrote, in memory. The fault fills it to the last byte with one
file beside the run dir; the operator's fix, after the run stopped, is to delete that file.
At the end the run's files are copied back onto the real disk at the same path (every path the
soak recorded stays valid) and the tmpfs is unmounted. Mounting needs root.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from drill.jobs import DrillError

log = logging.getLogger(__name__)

FILLER = "FILLER"  # at the tmpfs root, beside the run dir
HEADROOM = 64 << 20  # above the clean run's bytes times SIZE_FACTOR
SIZE_FACTOR = 3  # published steps kept, the step being written, metrics and logs


class DiskError(DrillError):
    """The soak's own file system could not be mounted or unmounted."""


def can_mount() -> bool:
    """Whether this process can mount a tmpfs (root alone is not enough: a container without
    CAP_SYS_ADMIN cannot): tried on a throwaway directory."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    probe = Path(tempfile.mkdtemp(prefix="soak-mount-probe-"))
    try:
        mounted = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(probe)], capture_output=True
        )
        if mounted.returncode != 0:
            return False
        subprocess.run(["umount", str(probe)], capture_output=True)
        return True
    finally:
        probe.rmdir()


def bytes_under(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def mount_tmpfs(where: Path, size: int) -> None:
    where.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise DiskError(f"cannot mount a {size >> 20} MiB tmpfs at {where}: {proc.stderr.strip()}")
    log.info("soak: the soak run writes to a %d MiB tmpfs at %s", size >> 20, where)


def unmount_keeping(where: Path) -> None:
    """Copy ``where``'s files onto the disk below it, unmount it, put the copy in its place."""
    copy = where.with_name(f".{where.name}.copy")
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(where, copy, symlinks=True, ignore=shutil.ignore_patterns(FILLER))
    proc = subprocess.run(["umount", str(where)], capture_output=True, text=True)
    if proc.returncode != 0:  # a process still holds a file there: detach it
        proc = subprocess.run(["umount", "-l", str(where)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise DiskError(
            f"cannot unmount the soak's tmpfs at {where} ({proc.stderr.strip()}); its files "
            f"are copied to {copy}: unmount it by hand"
        )
    where.rmdir()
    copy.rename(where)


def free_bytes(path: Path) -> int:
    stat = os.statvfs(path)
    return stat.f_bavail * stat.f_frsize


def fill(root: Path) -> int:
    """Write ``root/FILLER`` until the file system refuses another byte; the bytes left free."""
    chunk = 1 << 20
    fd = os.open(root / FILLER, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        while chunk:
            try:
                os.write(fd, bytes(chunk))
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                chunk //= 2
    finally:
        os.close(fd)
    return free_bytes(root)


def empty(root: Path) -> None:
    """The operator's fix: the filler deleted."""
    (root / FILLER).unlink(missing_ok=True)
