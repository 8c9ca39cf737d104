"""What `pretrain.data.prepare` reads: input files (loose JSON or plain text, optionally gzipped) and
the standard-library corpus, as ordered items that workers turn into per-key texts.

Loose JSON (``.json``/``.jsonl``, also ``.gz``): one JSON object per line, as Megatron-LM's
``tools/preprocess_data.py`` reads it; each ``--json-keys`` key holds a string (or a list of
strings: one sequence each). Any other file is one plain-text document under the key ``text``.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import sysconfig
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from pretrain.context.exit_codes import CONFIG_ERROR, DATA

JSON_SUFFIXES = (".json", ".jsonl")
TEXT_KEY = "text"  # plain-text and stdlib documents are this key
DEFAULT_STDLIB_MAX_BYTES = 4 * 1024 * 1024
# Tests, vendored/third-party code, demos and generated tables: not representative source code.
STDLIB_SKIP_DIRS = frozenset(
    {
        "site-packages",
        "dist-packages",
        "test",
        "tests",
        "idle_test",
        "idlelib",
        "lib2to3",
        "turtledemo",
        "__pycache__",
        "__phello__",
        "pydoc_data",
        "encodings",
        "lib-dynload",
    }
)


class PrepareError(ValueError):
    """The corpus cannot be prepared as asked: bad or missing input data (exit 9)."""

    exit_code = DATA


class PrepareConfigError(PrepareError):
    """The command line asks for something the inputs cannot give (exit 2)."""

    exit_code = CONFIG_ERROR


@dataclass(frozen=True)
class Item:
    """One unit of work: a loose-JSON line (``is_json``) or a whole plain-text document."""

    where: str  # "path:line" or "path", for messages
    data: bytes | str
    is_json: bool = False

    @property
    def nbytes(self) -> int:
        return len(self.data) if isinstance(self.data, bytes) else len(self.data.encode("utf-8"))


def is_json_input(path: str) -> bool:
    name = path[: -len(".gz")] if path.endswith(".gz") else path
    return name.endswith(JSON_SUFFIXES)


def expand_inputs(patterns: Sequence[str]) -> list[str]:
    """Files matched by each pattern, sorted per pattern; every pattern must match a file."""
    files: list[str] = []
    seen: set[str] = set()
    for pattern in patterns:
        # An existing path is taken literally so names containing glob characters still work.
        if os.path.isfile(pattern):
            matches = [pattern]
        else:
            matches = sorted(glob.glob(pattern, recursive=True))
        matches = [m for m in matches if os.path.isfile(m)]
        if not matches:
            raise PrepareError(f"--input {pattern!r} matched no files")
        files.extend(m for m in matches if m not in seen)
        seen.update(matches)
    return files


def check_keys(paths: Sequence[str], keys: Sequence[str]) -> None:
    """Plain-text files only have the key "text"; other keys need loose-JSON inputs."""
    if list(keys) == [TEXT_KEY]:
        return
    plain = [p for p in paths if not is_json_input(p)]
    if plain:
        raise PrepareConfigError(
            f"--json-keys {' '.join(keys)} needs loose-JSON inputs (.json/.jsonl), but "
            f"{plain[0]!r} is read as one plain-text document (key {TEXT_KEY!r} only)"
        )


def _open(path: str) -> IO[bytes]:
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def file_items(paths: Iterable[str]) -> Iterator[Item]:
    """Each loose-JSON line, or each plain-text file, in order."""
    for path in paths:
        try:
            with _open(path) as f:
                if is_json_input(path):
                    for lineno, raw in enumerate(f, start=1):
                        if raw.strip():
                            yield Item(f"{path}:{lineno}", raw, is_json=True)
                else:
                    yield Item(path, f.read())
        except (gzip.BadGzipFile, EOFError, zlib.error) as err:
            raise PrepareError(f"{path}: not a readable gzip file ({err})") from None
        except OSError as err:
            raise PrepareError(f"{path}: cannot read ({err.strerror or err})") from None


def _utf8(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise PrepareError(f"{where}: not valid UTF-8 ({err.reason} at byte {err.start})") from err


def item_texts(item: Item, keys: Sequence[str]) -> list[list[str]]:
    """The texts of `item` for each key, in key order: one string per sequence."""
    text = item.data if isinstance(item.data, str) else _utf8(item.data, item.where)
    if not item.is_json:
        return [[text]]
    try:
        record = json.loads(text)
    except json.JSONDecodeError as err:
        raise PrepareError(
            f"{item.where}: invalid JSON ({err.msg}); loose JSON is one object per line"
        ) from None
    if not isinstance(record, dict):
        raise PrepareError(f"{item.where}: a JSON {type(record).__name__}, expected an object")
    return [_sequences(record, key, item.where) for key in keys]


def _sequences(record: dict, key: str, where: str) -> list[str]:
    if key not in record:
        present = ", ".join(map(repr, list(record)[:5])) or "none"
        raise PrepareError(
            f"{where}: no {key!r} key in this line (keys: {present}); set --json-keys"
        )
    value = record[key]
    # A list is one document of several sequences, as Megatron-LM's --split-sentences writes.
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return value
    if not isinstance(value, str):
        raise PrepareError(
            f"{where}: {key!r} is {type(value).__name__}, expected a string or a list of strings"
        )
    return [value]


def text_document(path: str) -> str:
    # Bytes, not read_text(): no newline translation, so documents are the files verbatim.
    return _utf8(Path(path).read_bytes(), path)


def file_documents(paths: Iterable[str], json_key: str = TEXT_KEY) -> Iterator[str]:
    """The documents of `paths` under one key, as strings (sequences of a list joined)."""
    for item in file_items(paths):
        yield "".join(item_texts(item, [json_key])[0])


def stdlib_files() -> list[Path]:
    """This Python's standard-library .py files, in a fixed (sorted relative path) order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [
            d for d in dirnames if d not in STDLIB_SKIP_DIRS and not d.startswith("config-")
        ]
        files.extend(Path(dirpath, name) for name in filenames if name.endswith(".py"))
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def stdlib_documents(max_bytes: int = DEFAULT_STDLIB_MAX_BYTES) -> Iterator[str]:
    """Standard-library sources, one file per document, in order, up to max_bytes in total.

    A file that would overflow the budget is skipped rather than ending the walk, so the corpus
    fills the budget closely instead of stopping short before one large module.
    """
    budget = max_bytes
    for path in stdlib_files():
        if path.stat().st_size > budget:
            continue
        # Bytes, not read_text(): no newline translation, so the corpus is the files verbatim.
        raw = path.read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue  # a legacy-encoded file would only add mojibake
        budget -= len(raw)
        yield text


def input_bytes(paths: Sequence[str]) -> int | None:
    """Total bytes the items of `paths` will carry, when known up front (not for gzip)."""
    if any(p.endswith(".gz") for p in paths):
        return None
    return sum(os.path.getsize(p) for p in paths)
