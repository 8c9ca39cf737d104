"""File checksums and the per-file entries a manifest records.

crc32c is the default: measured on this host at ~14 GiB/s versus ~2 GiB/s for sha256, it is a
standard (iSCSI, ext4, GCS), hardware accelerated (SSE4.2 / ARMv8 CRC), and detects every burst
error of 32 bits or less. xxh3_64 was faster (~28 GiB/s) but is not a standard. We guard against
storage corruption, not adversaries; sha256 entries are still verified when a manifest has them.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import crc32c

from resiliency.layout import fsync_file

logger = logging.getLogger(__name__)

DEFAULT_ALGORITHM = "crc32c"
ALGORITHMS = ("crc32c", "sha256")
_BUF_BYTES = 8 << 20
_tls = threading.local()


class _Hasher(Protocol):
    def update(self, data: bytes | memoryview, /) -> None: ...

    def hexdigest(self) -> str: ...


class _Crc32c:
    def __init__(self) -> None:
        self._value = 0

    def update(self, data: bytes | memoryview) -> None:
        self._value = crc32c.crc32c(data, self._value)

    def hexdigest(self) -> str:
        return f"{self._value:08x}"


def _new_hasher(algorithm: str) -> _Hasher:
    if algorithm == "crc32c":
        return _Crc32c()
    if algorithm == "sha256":
        return hashlib.sha256()
    raise ValueError(f"unsupported checksum algorithm {algorithm!r} (supported: {ALGORITHMS})")


def _buffer() -> bytearray:
    # One buffer per thread, reused across files: hashing thousands of shards should not
    # allocate (and zero) 8 MiB each time.
    buf = getattr(_tls, "buf", None)
    if buf is None:
        buf = _tls.buf = bytearray(_BUF_BYTES)
    return buf


def bytes_checksum(data: bytes, algorithm: str = DEFAULT_ALGORITHM) -> str:
    hasher = _new_hasher(algorithm)
    hasher.update(data)
    return hasher.hexdigest()


def file_checksum(path: Path, algorithm: str = DEFAULT_ALGORITHM) -> str:
    hasher = _new_hasher(algorithm)
    buf = _buffer()
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            hasher.update(view[:n])
    return hasher.hexdigest()


@dataclass(frozen=True)
class FileEntry:
    path: str  # relative posix path inside the step dir
    bytes: int
    checksum: str
    algorithm: str = DEFAULT_ALGORITHM

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> FileEntry:
        if not isinstance(d, dict):
            raise ValueError(f"file entry is not an object: {d!r}")
        path, size, checksum = d.get("path"), d.get("bytes"), d.get("checksum")
        algorithm = d.get("algorithm", DEFAULT_ALGORITHM)
        if not isinstance(path, str) or not path:
            raise ValueError(f"file entry has no valid 'path': {d!r}")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ValueError(f"file entry {path!r} has invalid 'bytes': {size!r}")
        if not isinstance(checksum, str) or not isinstance(algorithm, str):
            raise ValueError(f"file entry {path!r} has invalid 'checksum'/'algorithm'")
        return cls(path, size, checksum, algorithm)


def describe_file(step_dir: Path, rel_path: str, algorithm: str = DEFAULT_ALGORITHM,
                  fsync: bool = True) -> FileEntry:
    path = step_dir / rel_path
    if fsync:
        # The rank that wrote a file is the one that describes it, so this is where its data
        # is forced to stable storage before the manifest can claim it exists.
        fsync_file(path)
    size = path.stat().st_size
    return FileEntry(Path(rel_path).as_posix(), size, file_checksum(path, algorithm), algorithm)


def describe_files(step_dir: Path, rel_paths: list[str], algorithm: str = DEFAULT_ALGORITHM,
                   fsync: bool = True) -> list[FileEntry]:
    """Entries for this rank's share of files in ``step_dir``; the coordinator gathers them."""
    entries = [describe_file(step_dir, rel, algorithm, fsync) for rel in rel_paths]
    logger.debug("described %d files (%d bytes) in %s", len(entries),
                 sum(e.bytes for e in entries), step_dir)
    return entries


def share_of(rel_paths: list[str], rank: int, world_size: int) -> list[str]:
    """Deterministic round-robin split so every rank hashes a disjoint part of the files."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} not in [0, {world_size})")
    return sorted(rel_paths)[rank::world_size]
