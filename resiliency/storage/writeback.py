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
    """Starts the writeback of one file descriptor's file each further ``CHUNK_BYTES`` written.
    ``wrote(n)`` after every write."""

    def __init__(self, fd: int | None) -> None:
        self._fd = fd if _SYNC_FILE_RANGE is not None else None
        self._unstarted = 0  # bytes written since the last start

    def wrote(self, nbytes: int) -> None:
        if self._fd is None:
            return
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


def early_writeback(stream: object) -> EarlyWriteback:
    """For a stream with a ``fileno`` (a file), or none at all (anything else: a no-op)."""
    try:
        fd = stream.fileno()  # type: ignore[attr-defined]
    except (AttributeError, OSError, ValueError):  # io.BytesIO raises UnsupportedOperation
        fd = None
    return EarlyWriteback(fd)
