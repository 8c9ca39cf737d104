"""Start the kernel's writeback of a file while it is still being written.

A buffered write only copies into the page cache. Below the kernel's dirty thresholds (10 % of
RAM by default: GiBs on a training node) nothing is written back until the ``fsync``, so the
disk idles while the writer copies and the writer idles while ``fsync`` waits for the disk.
``sync_file_range(SYNC_FILE_RANGE_WRITE)`` starts the writeback of what has been written so far
and returns without waiting for it, so the disk works during the copy (PostgreSQL's
``checkpoint_flush_after`` does the same for its checkpoints; measured in docs/checkpoints.md).

It is a hint only: durability still comes from the ``fsync`` the writer calls afterwards, and
with ``SYNC_FILE_RANGE_WRITE`` alone the kernel does not consume a writeback error, so that
``fsync`` still reports it. Where the call does not exist (not Linux) or a file refuses it
(a pipe), nothing happens. Python's ``os`` module has no binding for it, hence ctypes.

What has been written back is then dropped from the page cache (``POSIX_FADV_DONTNEED`` on
the file's bytes more than ``DROP_LAG_BYTES`` behind the writer, as ``dd oflag=nocache`` does;
the kernel drops clean pages only, skipping any still dirty or under writeback, which the next
call advises again; the advice does not wait for the disk and consumes no writeback error).
On storage that keeps up with the writer, a save's page-cache footprint stays at tens of MiB
per file instead of the checkpoint's size: a Kubernetes pod's memory limit counts the page
cache, and a checkpoint cached in full evicts the training data's pages. On this project's
VM, whose free memory goes back to its host, every page a write takes afresh costs several
microseconds more than one it recycles; a save that kept its 1.5 GiB cached made the next
write take 1.6-5x as long (docs/benchmarks.md, P1). The cost: a step read right after it was
written comes from the disk (a signed commit's SHA-256 pass, an upload; a restore after a
fault prefetches it anyway: restore/prefetch.py). The node-local tier keeps its pages
(``drop_behind=False``): it exists for restores at memory speed on the same node. tmpfs
ignores the advice.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
from collections.abc import Callable

log = logging.getLogger(__name__)

# Bytes written between two writeback starts: large enough that the calls cost nothing
# (48 for 0.75 GiB), small enough that little is left for the fsync at the end.
CHUNK_BYTES = 16 << 20
# Written bytes left in the page cache behind the writer: two chunks, whose writeback the
# kernel has had the time of a chunk's copy to finish (pages it has not are skipped, not lost).
DROP_LAG_BYTES = 2 * CHUNK_BYTES
_SYNC_FILE_RANGE_WRITE = 2  # linux/fs.h
# What a file system or file type that has no use for the hint answers.
_UNSUPPORTED = {errno.ESPIPE, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP}


def _libc_call() -> Callable[[int, int, int, int], int] | None:
    try:
        call = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):  # not Linux (glibc or musl)
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    call.restype = ctypes.c_int
    return call


_SYNC_FILE_RANGE = _libc_call()


class EarlyWriteback:
    """Starts the writeback of one file descriptor's file each further ``CHUNK_BYTES`` written,
    and drops what is more than ``DROP_LAG_BYTES`` behind from the page cache. ``wrote(n)``
    after every write."""

    def __init__(self, fd: int | None, drop_behind: bool = True) -> None:
        self._fd = fd if _SYNC_FILE_RANGE is not None else None
        self._unstarted = 0  # bytes written since the last start
        self._written = 0  # bytes written in all
        self._drops = drop_behind

    def wrote(self, nbytes: int) -> None:
        if self._fd is None:
            return
        self._written += nbytes
        self._unstarted += nbytes
        if self._unstarted < CHUNK_BYTES:
            return
        self._unstarted = 0
        # The whole file, every time: the kernel visits only its dirty pages, so this also
        # covers what a buffered stream handed over after the last call, and any seek.
        if _SYNC_FILE_RANGE(self._fd, 0, 0, _SYNC_FILE_RANGE_WRITE) != 0:
            code = ctypes.get_errno()
            level = logging.DEBUG if code in _UNSUPPORTED else logging.WARNING
            log.log(level, "early writeback of fd %d off: %s", self._fd, os.strerror(code))
            self._fd = None
            return
        self._drop_behind()

    def _drop_behind(self) -> None:
        """Advise the file's first bytes, up to the lag, out of the page cache. From the start
        every time: pages skipped while under writeback are dropped by a later call (the kernel
        visits only the pages still cached)."""
        upto = self._written - DROP_LAG_BYTES
        if not self._drops or upto <= 0:
            return
        try:
            os.posix_fadvise(self._fd, 0, upto, os.POSIX_FADV_DONTNEED)
        except OSError as err:  # a file that takes no advice: the writeback starts go on
            level = logging.DEBUG if err.errno in _UNSUPPORTED else logging.WARNING
            log.log(level, "dropping written pages of fd %d off: %s", self._fd, err)
            self._drops = False


def early_writeback(stream: object, drop_behind: bool = True) -> EarlyWriteback:
    """For a stream with a ``fileno`` (a file), or none at all (anything else: a no-op)."""
    try:
        fd = stream.fileno()  # type: ignore[attr-defined]
    except (AttributeError, OSError, ValueError):  # io.BytesIO raises UnsupportedOperation
        fd = None
    return EarlyWriteback(fd, drop_behind)
