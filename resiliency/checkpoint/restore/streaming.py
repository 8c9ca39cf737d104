"""A torch DCP reader that reads each tensor's bytes once, straight into its destination.

torch's ``FileSystemReader`` loads every stored tensor with ``torch.load`` on a view of the shard
file (a zip archive per item: its pickle, then one data record), which reads the bytes into a new
tensor, and then copies that tensor into the destination the load planner names: two passes
over every byte, plus the archive machinery per item. Here the archive's small records (the
pickle, the byte order) are read to learn the stored tensor's dtype, shape, strides and where
its data record starts; when the part a request wants is one contiguous run of bytes in that
record, it is read with ``preadv`` straight into the destination (or, for a destination that
is not a contiguous CPU tensor, into one scratch tensor that is then copied there once).
Anything else (byte items, transformed streams, a layout this does not recognise) goes through
torch's own path, so the loaded state is the same either way (tests/unit/resiliency/
test_streaming_load.py compares both with the saved tensors).

The files of this rank's re-hash share that it reads are checked on the way (share_check.py):
read start to end in offset order, the bytes between the wanted tensors too, the crc32c chained
over each run of bytes as it lands, compared with the manifest at the file's end.

The pickle is read with torch's weights-only unpickler, as ``torch.load(weights_only=True)``
reads it in the path it replaces, with storages on the meta device: nothing is allocated and no
global outside torch's allow-list is admitted.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import logging
import os
import pickle
import struct
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from resiliency.checkpoint.restore.share_check import ShareCheck
from resiliency.storage.checksum import FileEntry, file_checksum, new_hasher
from resiliency.storage.layout import MODEL_DIR

log = logging.getLogger(__name__)

_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")  # a zip local file header (30 bytes)
_LOCAL_HEADER_SIGNATURE = 0x04034B50


class NotStreamable(Exception):
    """This item is read by torch's own path."""


# An archive this reader does not recognise: torch's path reads it (and raises what it raises).
_UNRECOGNISED = (
    NotStreamable,
    ValueError,
    KeyError,
    struct.error,
    UnicodeDecodeError,
    pickle.UnpicklingError,
    RuntimeError,
)


@dataclass
class ReadStats:
    """What one load read, and how: for the restore log line and the tests."""

    streamed_items: int = 0
    streamed_bytes: int = 0
    fallback_items: int = 0

    def describe(self) -> str:
        return (
            f"{self.streamed_items} tensors ({self.streamed_bytes / 2**30:.3f} GiB) read straight "
            f"into place, {self.fallback_items} items through torch.load"
        )


@dataclass(frozen=True)
class StoredTensor:
    """A tensor item of a shard file: its layout (a meta tensor) and where its data starts."""

    layout: torch.Tensor
    data_at: int  # absolute offset of the data record in the shard file


class StreamingReader(FileSystemReader):
    """``FileSystemReader`` with a single-pass tensor read; the metadata is read once."""

    def __init__(self, path: str | os.PathLike, share_check: ShareCheck | None = None) -> None:
        super().__init__(path)
        self._metadata: Any = None
        self.stats = ReadStats()
        self._share_check = share_check
        self._stored: dict[tuple[str, int], StoredTensor | None] = {}

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        # megatron reads it again after the load (its cached-metadata reader does the same)
        if kwargs.get("rank") is not None:
            return super().read_metadata(*args, **kwargs)
        if self._metadata is None:
            self._metadata = super().read_metadata(*args, **kwargs)
        return self._metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(
                item
            )
        fallback: list[ReadItem] = []
        for relative_path, items in per_file.items():
            fd = os.open(Path(self.path) / relative_path, os.O_RDONLY)
            try:  # in file order: one sequential pass over the file
                crc = self._claim(fd, relative_path)
                for item in sorted(items, key=lambda i: self.storage_data[i.storage_index].offset):
                    if not self._read_straight(fd, relative_path, item, planner, crc):
                        fallback.append(item)
                if crc is not None and self._share_check is not None:
                    self._share_check.checked(crc.entry.path, crc.finish())
            finally:
                os.close(fd)
        self.stats.fallback_items += len(fallback)
        if fallback:
            return super().read_data(dataclasses.replace(plan, items=fallback), planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _claim(self, fd: int, relative_path: str) -> FileCrc | None:
        """The file's checksum, chained as it is read, if the share check gives it to the read."""
        if self._share_check is None:
            return None
        entry = self._share_check.claim(f"{MODEL_DIR}/{relative_path}")
        return FileCrc(fd, entry, Path(self.path) / relative_path) if entry is not None else None

    def _read_straight(
        self,
        fd: int,
        relative_path: str,
        item: ReadItem,
        planner: LoadPlanner,
        crc: FileCrc | None = None,
    ) -> bool:
        info = self.storage_data[item.storage_index]
        if item.type == LoadItemType.BYTE_IO or getattr(info, "transform_descriptors", None):
            return False
        key = (relative_path, info.offset)
        if key not in self._stored:
            try:
                self._stored[key] = stored_tensor(fd, info.offset, info.length)
            except _UNRECOGNISED as exc:
                log.debug("restore: %s@%d read by torch.load (%s)", relative_path, info.offset, exc)
                self._stored[key] = None
        stored = self._stored[key]
        if stored is None:
            return False
        part = narrow_tensor_by_index(stored.layout, item.storage_offsets, item.lengths)
        if not part.is_contiguous():
            return False
        target = planner.resolve_tensor(item).detach()
        if target.size() != part.size():  # torch's own check, same message
            raise AssertionError(
                f"req {item.storage_index} mismatch sizes {target.size()} vs {part.size()}"
            )
        direct = (
            target.device.type == "cpu" and target.is_contiguous() and target.dtype == part.dtype
        )
        dest = target if direct else torch.empty(part.size(), dtype=part.dtype)
        start = stored.data_at + part.storage_offset() * part.element_size()
        if crc is not None:
            crc.upto(start)
        read_exactly(fd, start, byte_view(dest))
        if crc is not None:
            crc.add(byte_view(dest))
        if not direct:
            target.copy_(dest)
        planner.commit_tensor(item, target)
        self.stats.streamed_items += 1
        self.stats.streamed_bytes += dest.numel() * dest.element_size()
        return True


class FileCrc:
    """A file's crc32c chained over its bytes in offset order: the runs the read placed, and
    the gaps between them read here. Out of order (two parts of one record overlapping), the
    whole file is re-hashed at the end instead."""

    GAP_BYTES = 8 << 20

    def __init__(self, fd: int, entry: FileEntry, path: Path) -> None:
        self.fd, self.entry, self.path = fd, entry, path
        self.size = os.fstat(fd).st_size
        self.hasher = new_hasher(entry.algorithm)
        self.pos, self.in_order = 0, True
        self._buf: bytearray | None = None

    def upto(self, offset: int) -> None:
        """Chain the bytes in [pos, offset) (not read by the load)."""
        if offset < self.pos:
            self.in_order = False
        if not self.in_order:
            return
        want = min(self.GAP_BYTES, offset - self.pos)
        if self._buf is None or len(self._buf) < want:
            self._buf = bytearray(want)
        while self.pos < offset:
            view = memoryview(self._buf)[: min(len(self._buf), offset - self.pos)]
            read_exactly(self.fd, self.pos, view)
            self.hasher.update(view)
            self.pos += len(view)

    def add(self, data: memoryview) -> None:
        """Chain ``data``, the file's bytes at pos (just read into place)."""
        if self.in_order:
            self.hasher.update(data)
            self.pos += len(data)

    def finish(self) -> str | None:
        """The file's verdict against its manifest entry (None: it matches)."""
        entry = self.entry
        if self.size != entry.bytes:
            return f"file {entry.path!r} has {self.size} bytes, manifest says {entry.bytes}"
        self.upto(self.size)
        actual = (
            self.hasher.hexdigest() if self.in_order else file_checksum(self.path, entry.algorithm)
        )
        if actual != entry.checksum:
            return (
                f"file {entry.path!r} {entry.algorithm} mismatch: {actual} != manifest "
                f"{entry.checksum}"
            )
        return None


def stored_tensor(fd: int, offset: int, length: int) -> StoredTensor:
    """The layout and data offset of the ``torch.save`` archive at [offset, offset+length).

    The archive's records are walked from its start: torch writes the pickle and the byte order
    before the data record, so finding the data costs one small read just before the data, in
    file order (the central directory at the archive's end is not read). torch streams the
    archive, so a record's size follows it in a data descriptor: the small records' sizes are
    found there; the data record's size is the storage's (from the pickle), checked against its
    descriptor."""
    head = os.pread(fd, min(_HEAD_READ, length), offset)
    records: dict[str, tuple[int, int]] = {}  # short name -> (data start in the archive, size)
    at = 0
    while True:
        name, start, flags, header_size = _local_header(head, at)
        if name.startswith("data/"):
            break
        size = _descriptor_size(head, start) if flags & _SIZES_AFTER else header_size
        records[name] = (start, size)
        at = _next_header(head, start + size, flags)
    order = records.get("byteorder")
    if order is not None and head[order[0] : sum(order)].decode() != sys.byteorder:
        raise NotStreamable("stored with the other byte order")
    if "data.pkl" not in records:
        raise NotStreamable("no pickle before the data")
    layout = _layout(head[records["data.pkl"][0] : sum(records["data.pkl"])])
    size = layout.untyped_storage().nbytes()
    if flags & _SIZES_AFTER:
        after = os.pread(fd, _DESCRIPTOR_MAX, offset + start + size)
        if not _descriptor_says(after, 0, size):
            raise NotStreamable("the data record's size differs from the storage's")
    elif header_size != size:
        raise NotStreamable("the data record's size differs from the storage's")
    if start + size > length:
        raise NotStreamable("data record past the item's end")
    return StoredTensor(layout, offset + start)


_HEAD_READ = 16 << 10  # the records before the data: a pickle of a few hundred bytes, typically
_SIZES_AFTER = 0x08  # general-purpose flag bit 3: sizes in a data descriptor after the data
_DESCRIPTOR = b"PK\x07\x08"
_DESCRIPTOR_MAX = 24  # signature, crc32, then 32-bit (16 bytes) or zip64 (24 bytes) sizes


def _local_header(head: bytes, at: int) -> tuple[str, int, int, int]:
    """(record name without the archive's folder, data start, flags, size in the header)."""
    if at + _LOCAL_HEADER.size > len(head):
        raise NotStreamable("the records before the data are longer than read")
    fields = _LOCAL_HEADER.unpack_from(head, at)
    signature, flags, method, size = fields[0], fields[2], fields[3], fields[7]
    name_len, extra_len = fields[9], fields[10]
    if signature != _LOCAL_HEADER_SIGNATURE:
        raise NotStreamable("no local header where the next record should start")
    if method != zipfile.ZIP_STORED:
        raise NotStreamable("a compressed record")
    name_at = at + _LOCAL_HEADER.size
    name = head[name_at : name_at + name_len].decode()
    return name.split("/", 1)[-1], name_at + name_len + extra_len, flags, size


def _descriptor_says(buf: bytes, pos: int, size: int) -> bool:
    """A data descriptor at ``pos`` records ``size`` (32-bit or zip64 sizes)."""
    if buf[pos : pos + 4] != _DESCRIPTOR:
        return False
    short = len(buf) >= pos + 16 and struct.unpack_from("<I", buf, pos + 8)[0] == size
    wide = len(buf) >= pos + 24 and struct.unpack_from("<Q", buf, pos + 8)[0] == size
    return short or wide


def _descriptor_size(head: bytes, start: int) -> int:
    """A small record's size: the distance to the first descriptor that records it."""
    pos = head.find(_DESCRIPTOR, start)
    while pos >= 0:
        if _descriptor_says(head, pos, pos - start):
            return pos - start
        pos = head.find(_DESCRIPTOR, pos + 1)
    raise NotStreamable("no data descriptor in the archive's head")


def _next_header(head: bytes, end: int, flags: int) -> int:
    if not flags & _SIZES_AFTER:
        return end
    for width in (16, 24):  # 32-bit or zip64 descriptor: the next header tells which
        if head[end + width : end + width + 4] == b"PK\x03\x04":
            return end + width
    raise NotStreamable("no local header after a data descriptor")


@functools.lru_cache(maxsize=256)  # same-shaped tensors pickle alike: a model has a few dozen
def _layout(pickled: bytes) -> torch.Tensor:
    """The stored tensor rebuilt on the meta device (no bytes read), by torch's weights-only
    unpickler (the allow-list ``torch.load(weights_only=True)`` uses). Shared between the
    items whose pickles are identical: only ever narrowed into views, never written."""
    from torch._weights_only_unpickler import Unpickler

    def persistent_load(saved_id: Any) -> Any:
        kind, storage_type, _key, _location, numel = saved_id
        if kind != "storage":
            raise NotStreamable(f"persistent id {kind!r}")
        dtype = getattr(storage_type, "dtype", storage_type)
        nbytes = numel * torch._utils._element_size(dtype)
        storage = torch.UntypedStorage(nbytes, device="meta")
        return torch.storage.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)

    unpickler = Unpickler(io.BytesIO(pickled), encoding="utf-8")
    unpickler.persistent_load = persistent_load  # type: ignore[attr-defined]
    layout = unpickler.load()
    if not isinstance(layout, torch.Tensor) or layout.device.type != "meta":
        raise NotStreamable(f"pickle holds {type(layout).__name__}")
    return layout


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The contiguous CPU tensor's memory, writable, as bytes."""
    flat = tensor.reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def read_exactly(fd: int, offset: int, into: memoryview) -> None:
    done = 0
    while done < len(into):
        got = os.preadv(fd, [into[done:]], offset + done)
        if got == 0:
            raise OSError(f"shard file ends {len(into) - done} bytes early (at {offset + done})")
        done += got
