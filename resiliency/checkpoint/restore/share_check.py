"""This rank's share of a step's files, checked once: by the shard read where it reads them,
by the re-hash thread where it does not.

Before a restore applies anything, every file of the step is re-hashed by one rank
(``storage.verify.balanced_share``: a rank's own shard files are its share). The same rank
also reads those shards into place (restore/streaming.py). Reading a file twice (the re-hash
and the load, on two threads) cost ~0.5 s of a 1.5 GiB restore on two cores, so the load checks
the files of the share it reads: it reads each such file start to end in offset order (the
gaps between the tensors it wants too) and chains the crc32c over the bytes as they land.
The re-hash thread checks everything else of the share: the small files at once, the shard
files only after the read (:meth:`ShareCheck.release`), skipping those the read checked.

Every file of the share is checked exactly once, by one of the two, before the confirm (the
plan's collective) reads the verdicts: a read that fails midway leaves its unchecked claims to
the re-hash.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from resiliency.storage.checksum import FileEntry

SHARD_SUFFIX = ".distcp"


@dataclass
class ShareCheck:
    """Claims and verdicts of the shard files of this rank's share (``share``: rel path in the
    step dir -> its manifest entry)."""

    share: dict[str, FileEntry]
    reads_shards: bool  # a streaming read will come: the re-hash leaves shard files to it
    problem: str | None = None  # the first mismatch the read found
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _released: threading.Event = field(default_factory=threading.Event, repr=False)
    _claimed: set[str] = field(default_factory=set)
    _checked: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        if not self.reads_shards:
            self._released.set()

    @staticmethod
    def is_shard(rel_path: str) -> bool:
        return rel_path.endswith(SHARD_SUFFIX)

    def claim(self, rel_path: str) -> FileEntry | None:
        """The read takes ``rel_path`` (its entry), unless it is no shard file of this rank's
        share, has no crc32c, or the read is already over."""
        entry = self.share.get(rel_path)
        if entry is None or entry.algorithm != "crc32c" or not self.is_shard(rel_path):
            return None
        with self._lock:
            if self._released.is_set():
                return None
            self._claimed.add(rel_path)
        return entry

    def checked(self, rel_path: str, problem: str | None) -> None:
        """The read finished ``rel_path``: its verdict (None: it matches the manifest)."""
        with self._lock:
            self._checked.add(rel_path)
            if problem is not None and self.problem is None:
                self.problem = problem

    @property
    def checked_paths(self) -> frozenset[str]:
        """The files the read checked to their end."""
        with self._lock:
            return frozenset(self._checked)

    def release(self) -> None:
        """The read is over (or will not happen): claims it did not finish go to the re-hash.
        Idempotent."""
        with self._lock:
            self._claimed &= self._checked
            self._released.set()

    def rehash_takes(self, rel_path: str) -> bool:
        """The re-hash thread, before a file: whether it hashes it. A shard file waits for the
        read to end (the confirm releases it at the latest; the thread is a daemon, so a rank
        that leaves before does not wait for it) and is skipped if the read checked it."""
        if not self.is_shard(rel_path):
            return True
        self._released.wait()
        with self._lock:
            return rel_path not in self._claimed
