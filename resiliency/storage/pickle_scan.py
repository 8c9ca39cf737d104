"""Which globals would unpickling a checkpoint file import? Found without unpickling anything.

A pickle runs code only through the globals it names (a class to build, a function to call):
``pickletools.genops`` walks the opcodes and this module resolves every GLOBAL, INST and
STACK_GLOBAL to its (module, qualname), and refuses what it cannot name (EXT1/2/4, whose
meaning lives in the loading process's copyreg registry; a STACK_GLOBAL whose two names are not
plain string pushes or memo gets of them). The pickles of a step are ``model/.metadata`` (torch
DCP's raw pickle), every item of the ``*.distcp`` files (each a torch zip archive at the offset
``.metadata`` gives it, read with ``torch.load``), and the ``*.pt`` files (torch zip archives:
their ``data.pkl``; a ``.pt`` that is no zip archive is never unpickled: compat's loads refuse
it unread); nvrx's node-local files are torch zip archives too. A file naming a global outside
``pretrain.platform.checkpoint_globals`` is refused with one line naming it.

The walk is Python, one call per opcode (0.08 s for a 1.5 GiB step's 180 KB ``.metadata`` on the
development VM), and a restore meets the same pickles many times: the ``.metadata`` before the
load and again in the re-hash, and one pickle per tensor item, alike for same-shaped tensors (12
distinct among a 1.5 GiB step's 428). A verdict that admits is remembered per content (the
pickle's blake2b digest and the allow-list), so each distinct pickle is walked once per process.
Not unpickled instead, even with stand-ins, because CPython's C unpickler sizes its memo array by
the largest index a PUT names: five bytes can make it allocate gigabytes. The walk refuses such a
pickle (no fresh pickler writes a memo index past its own length), so the stand-in read of an
admitted ``.metadata`` below, and DCP's own load of it, cannot be made to.

Torch-free (the storage layer loads no torch): item offsets are read from ``.metadata`` by an
unpickler whose every global is a stand-in record, so even that read runs nothing of the file.
"""

from __future__ import annotations

import _compat_pickle
import hashlib
import io
import pickle
import pickletools
import struct
import threading
import zipfile
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path, PurePosixPath
from types import MappingProxyType
from typing import IO, Any

from pretrain.platform.checkpoint_globals import (
    UnsafeCheckpointError,
    admitted_globals,
    global_name,
    refusal,
)

DCP_METADATA = ".metadata"
_STRINGS = {
    "SHORT_BINUNICODE",
    "BINUNICODE",
    "BINUNICODE8",
    "UNICODE",
    "SHORT_BINSTRING",
    "BINSTRING",
    "STRING",
}
_GETS = {"GET", "BINGET", "LONG_BINGET"}
_PUTS = {"PUT", "BINPUT", "LONG_BINPUT"}
_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")  # a zip member's local file header
_ZIP_MAGIC = b"PK\x03\x04"


def pickle_globals(data: bytes | memoryview, where: str) -> list[tuple[str, str]]:
    """Every (module, qualname) the pickle in ``data`` names, in order, as the unpickler
    resolves it (protocols 0-2 map Python 2 names: ``__builtin__`` is ``builtins``); raises
    UnsafeCheckpointError for an opcode whose global cannot be named without running anything."""
    found: list[tuple[str, str]] = []
    proto = 0
    memo: dict[int, str | None] = {}
    top: str | None = None  # the stack's top item when it is a plain string, else None
    pushed: list[str | None] = []  # what each of the last stack-changing opcodes pushed
    try:
        for op, arg, _ in pickletools.genops(data):
            name = op.name
            if name in _PUTS and arg > len(data):  # no fresh pickler writes one: C would
                raise UnsafeCheckpointError(  # allocate a memo array of twice that many slots
                    f"checkpoint file {where} stores into memo slot {arg}, beyond its "
                    f"{len(data)} bytes: refused (the unpickler would allocate memory for it)"
                )
            if name in _PUTS or name == "MEMOIZE":
                memo[len(memo) if name == "MEMOIZE" else arg] = top
                continue  # the stack is unchanged
            if name == "FRAME":
                continue
            if name == "PROTO":
                proto = arg
            if name in _STRINGS:
                top = arg if isinstance(arg, str) else None
            elif name in _GETS:
                top = memo.get(arg)
            elif name in ("GLOBAL", "INST"):
                module, _, qualname = arg.partition(" ")
                found.append(_as_loaded(module, qualname, proto))
                top = None
            elif name == "STACK_GLOBAL":
                module, qualname = ([None, None] + pushed)[-2:]
                if module is None or qualname is None:
                    raise UnsafeCheckpointError(
                        f"checkpoint file {where} names a global (STACK_GLOBAL) from values "
                        "that are not plain strings: refused without running it"
                    )
                found.append(_as_loaded(module, qualname, proto))
                top = None
            elif name.startswith("EXT"):
                raise UnsafeCheckpointError(
                    f"checkpoint file {where} names a global through the copyreg extension "
                    f"registry ({name} code {arg}), which the checkpoint loader does not admit"
                )
            else:
                top = None
            pushed.append(top)
            del pushed[:-2]
    except ValueError as exc:  # genops: truncated data, an unknown opcode
        raise UnsafeCheckpointError(
            f"checkpoint file {where} is not a readable pickle: {exc}"
        ) from exc
    return found


def _as_loaded(module: str, qualname: str, proto: int) -> tuple[str, str]:
    """The name ``pickle.Unpickler.find_class`` (and torch's weights-only unpickler) looks up."""
    if proto < 3:
        if (module, qualname) in _compat_pickle.NAME_MAPPING:
            return _compat_pickle.NAME_MAPPING[(module, qualname)]
        module = _compat_pickle.IMPORT_MAPPING.get(module, module)
    return module, qualname


def check_pickle(
    data: bytes | memoryview, where: str, admitted: frozenset[tuple[str, str]] | None = None
) -> None:
    """Raise UnsafeCheckpointError naming the first global ``data`` needs that is not admitted."""
    allowed = admitted_globals() if admitted is None else admitted
    key = (_digest(data), allowed)
    if key in _ADMITTED:
        return
    for module, qualname in pickle_globals(data, where):
        if (module, qualname) not in allowed:
            raise UnsafeCheckpointError(refusal(where, global_name(module, qualname)))
    _remember(_ADMITTED, key, True)


# Pickles the walk admitted, by (digest, allow-list): bounded, oldest forgotten first.
_ADMITTED: dict[tuple[bytes, frozenset[tuple[str, str]]], bool] = {}
_REMEMBERED_LOCK = threading.Lock()  # the restore's main thread and its re-hash thread


def _digest(data: bytes | memoryview) -> bytes:
    """What the caches below know a pickle by: its content."""
    return hashlib.blake2b(data, digest_size=32).digest()


def _remember(cache: dict[Any, Any], key: Any, value: Any, bound: int = 4096) -> None:
    with _REMEMBERED_LOCK:
        if len(cache) >= bound:
            del cache[next(iter(cache))]
        cache[key] = value


class _Window(io.RawIOBase):
    """Bytes ``[start, start + length)`` of an open binary file, as a seekable file of its own
    (what ``torch.load`` is given for a DCP item)."""

    def __init__(self, raw: IO[bytes], start: int, length: int) -> None:
        self._raw, self._start, self._length, self._pos = raw, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        want = min(len(buffer), max(0, self._length - self._pos))
        self._raw.seek(self._start + self._pos)
        data = self._raw.read(want)
        buffer[: len(data)] = data
        self._pos += len(data)
        return len(data)


def zip_pickles(stream: IO[bytes], where: str) -> Iterator[tuple[str, bytes]]:
    """(where, bytes) of every ``*.pkl`` member of the torch zip archive in ``stream``. The
    bytes are read from the member's own header on (torch writes stored members, and may
    leave their CRC unset: zipfile's CRC check would refuse good files)."""
    stream.seek(0)
    if stream.read(4) != _ZIP_MAGIC:
        raise UnsafeCheckpointError(f"checkpoint file {where} is not a torch zip archive")
    try:
        members = zipfile.ZipFile(stream).infolist()
    except (zipfile.BadZipFile, ValueError, EOFError) as exc:
        raise UnsafeCheckpointError(
            f"checkpoint file {where} is not a readable zip: {exc}"
        ) from exc
    names = [m.filename for m in members]
    if len(set(names)) != len(names):
        raise UnsafeCheckpointError(f"checkpoint file {where} has two zip members of one name")
    for member in members:
        if PurePosixPath(member.filename).name == "constants.pkl":
            raise UnsafeCheckpointError(f"checkpoint file {where} is a TorchScript archive (code)")
        if not member.filename.endswith(".pkl"):
            continue
        if member.compress_type != zipfile.ZIP_STORED:
            raise UnsafeCheckpointError(
                f"checkpoint file {where} has a compressed {member.filename}"
            )
        stream.seek(member.header_offset)
        header = stream.read(_LOCAL_HEADER.size)
        if len(header) != _LOCAL_HEADER.size or header[:4] != _ZIP_MAGIC:
            raise UnsafeCheckpointError(f"checkpoint file {where}: {member.filename} has no header")
        fields = _LOCAL_HEADER.unpack(header)
        stream.seek(member.header_offset + _LOCAL_HEADER.size + fields[9] + fields[10])
        data = stream.read(member.compress_size)
        if len(data) != member.compress_size:
            raise UnsafeCheckpointError(f"checkpoint file {where}: {member.filename} is truncated")
        yield f"{where} ({member.filename})", data


def check_torch_file(
    stream: IO[bytes], where: str, admitted: frozenset[tuple[str, str]] | None = None
) -> None:
    """A torch zip archive (``torch.save``): every pickle in it names admitted globals only."""
    for member, data in zip_pickles(stream, where):
        check_pickle(data, member, admitted)


class _Record:
    """Stand-in for any global of a DCP ``.metadata`` pickle: keeps what it was given."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        record = super().__new__(cls)
        record.__dict__["_args"] = args
        return record

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.__dict__["_args"] = args

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):
            state, slots = state  # (__dict__ or None, slots)
            self.__dict__.update(slots)
        if isinstance(state, dict):
            self.__dict__.update(state)
        elif state is not None:  # a class's own __getstate__ form
            self.__dict__["_state"] = state


class _RecordUnpickler(pickle.Unpickler):
    """Every global becomes a stand-in class; no module is imported, no function called."""

    _records: dict[tuple[str, str], type] = {}
    _BUILTINS = {("collections", "OrderedDict"): dict, ("builtins", "set"): set}

    def find_class(self, module: str, name: str) -> Any:
        key = (module, name)
        if key in self._BUILTINS:
            return self._BUILTINS[key]
        if key not in self._records:
            self._records[key] = type(name.rpartition(".")[2], (_Record,), {})
        return self._records[key]

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("a DCP .metadata pickle has no persistent ids")


def dcp_items(metadata: bytes, where: str) -> dict[str, list[tuple[int, int]]]:
    """From a DCP ``.metadata`` pickle (already scanned): {data file: [(offset, length)]} of
    every item ``torch.load`` reads from those files."""
    try:
        loaded = _RecordUnpickler(io.BytesIO(metadata)).load()
        items: dict[str, list[tuple[int, int]]] = {}
        for info in loaded.storage_data.values():
            if getattr(info, "transform_descriptors", None):
                raise UnsafeCheckpointError(
                    f"checkpoint file {where} stores items through stream transforms, "
                    "which the checkpoint scan cannot read"
                )
            name = info.relative_path
            if not isinstance(name, str) or PurePosixPath(name).name != name or "\\" in name:
                raise UnsafeCheckpointError(
                    f"checkpoint file {where} points an item at {name!r}, which is not a "
                    "file of its own directory"
                )
            if not name.endswith(".distcp"):  # the scan reads items of *.distcp files only
                raise UnsafeCheckpointError(
                    f"checkpoint file {where} points an item at {name!r}, not a .distcp file"
                )
            offset, length = int(info.offset), int(info.length)
            items.setdefault(name, []).append((offset, length))
    except UnsafeCheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - any shape but DCP's is a file we cannot vouch for
        raise UnsafeCheckpointError(
            f"checkpoint file {where} is not a DCP metadata pickle the scan can read: {exc!r}"
        ) from exc
    return items


def _dcp_items_of(step_dir: Path, model_dir: str, cache: dict) -> Mapping[str, list]:
    if model_dir not in cache:
        rel = str(PurePosixPath(model_dir) / DCP_METADATA)
        try:
            data = (step_dir / rel).read_bytes()
        except FileNotFoundError:  # no metadata: torch reads no item of this directory
            cache[model_dir] = {}
            return {}
        cache[model_dir] = _scanned_dcp_items(data, rel)
    return cache[model_dir]


# .metadata item offsets by (digest, where, allow-list): a restore reads them before the load
# and again in the re-hash.
_DCP_ITEMS: dict[tuple[bytes, str, frozenset], Mapping[str, list[tuple[int, int]]]] = {}


def _scanned_dcp_items(metadata: bytes, where: str) -> Mapping[str, list[tuple[int, int]]]:
    key = (_digest(metadata), where, admitted_globals())
    items = _DCP_ITEMS.get(key)
    if items is None:
        check_pickle(metadata, where, key[2])
        items = MappingProxyType(dcp_items(metadata, where))
        _remember(_DCP_ITEMS, key, items, bound=64)
    return items


def check_step_files(step_dir: Path, rels: Iterable[str]) -> None:
    """Scan the pickle-bearing files among ``rels`` (paths relative to ``step_dir``): a DCP
    ``.metadata``, the items of a ``*.distcp`` file, a ``*.pt`` torch archive. Other files
    (JSON, text) are never unpickled. Raises UnsafeCheckpointError (or OSError)."""
    # Each file is read once by the rank whose share holds it; a .distcp's item offsets come
    # from its directory's .metadata, scanned (cheaply) by every rank that needs them.
    metadata: dict[str, dict[str, list]] = {}
    for rel in rels:
        pure = PurePosixPath(rel)
        path = step_dir / rel
        if pure.name == DCP_METADATA:
            _dcp_items_of(step_dir, str(pure.parent), metadata)
        elif pure.suffix == ".pt":
            with path.open("rb") as stream:
                # Not a zip archive: no loader of step files unpickles it (compat's
                # safe_torch_load refuses it unread), so there is nothing here to run.
                if stream.read(len(_ZIP_MAGIC)) == _ZIP_MAGIC:
                    check_torch_file(stream, rel)
        elif pure.suffix == ".distcp":
            items = _dcp_items_of(step_dir, str(pure.parent), metadata).get(pure.name, [])
            with path.open("rb") as stream:
                for offset, length in items:
                    check_torch_file(_Window(stream, offset, length), f"{rel} at byte {offset}")


def step_pickle_problem(step_dir: Path, rels: Iterable[str]) -> str | None:
    """One line for the first file among ``rels`` whose pickles would run something the
    checkpoint loader does not admit, or None."""
    try:
        check_step_files(Path(step_dir), rels)
    except UnsafeCheckpointError as exc:
        return str(exc)
    except OSError as exc:
        return f"I/O error on {exc.filename or step_dir}: {exc.strerror or exc}"
    return None


def file_pickle_problem(path: Path, where: str) -> str | None:
    """The same for one torch zip archive (a node-local checkpoint file)."""
    try:
        with Path(path).open("rb") as stream:
            check_torch_file(stream, where)
    except UnsafeCheckpointError as exc:
        return str(exc)
    return None
