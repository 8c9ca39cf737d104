"""The data snapshot a checkpoint recorded, against the corpus a resume would read.

A step's manifest holds the checksum of each dataset prefix's ``.idx`` file
(``dataset["index_files"]``, ``{prefix + ".idx": crc32c}``). The saved data cursor counts samples
of that index: a corpus rebuilt under the same prefix would resume at a cursor that now means
other samples, so a resume compares them first (``checkpoint.restore.plan.check_corpus``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from resiliency.storage.checksum import file_checksum

INDEX_SUFFIX = ".idx"
# (path, device, inode, size, mtime_ns, ctime_ns) -> checksum: a file rewritten in any way gets
# a new mtime/ctime (or inode), so only an unchanged file is not read again. In-process only.
_cache: dict[tuple[str, int, int, int, int, int], str] = {}


def index_checksum(path: Path) -> str | None:
    """The ``.idx`` file's checksum as the checkpointer records it; None if it is missing."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    key = (str(path.resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if key not in _cache:
        _cache[key] = file_checksum(path)
    return _cache[key]


def index_files(prefixes: list[str]) -> dict[str, str]:
    """What a step records as ``dataset["index_files"]``: each existing ``.idx`` of ``prefixes``
    and its checksum (a prefix without one, mock data, records nothing)."""
    files = [prefix + INDEX_SUFFIX for prefix in prefixes]
    found = {file: index_checksum(Path(file)) for file in files}
    return {file: checksum for file, checksum in found.items() if checksum is not None}


def corpus_changes(saved: Mapping[str, str], prefixes: list[str]) -> list[dict[str, Any]]:
    """How the index files of ``prefixes`` differ from those a checkpoint recorded (``saved``:
    its ``index_files``): one dict per difference, empty when the corpus is the same."""
    current = {prefix + INDEX_SUFFIX: prefix for prefix in prefixes}
    changes = []
    for file in sorted(set(saved) | set(current)):
        prefix = current.get(file, file.removesuffix(INDEX_SUFFIX))
        was = saved.get(file)
        now = index_checksum(Path(file)) if file in current else None
        if file not in current:
            change = "removed"  # a prefix the checkpoint trained on is no longer in data.paths
        elif was is None:
            change = "added"
        elif now is None:
            change = "missing"
        elif now != was:
            change = "changed"
        else:
            continue
        changes.append({"prefix": prefix, "file": file, "change": change, "saved": was, "now": now})
    return changes


def describe_change(change: Mapping[str, Any]) -> str:
    prefix, file = change["prefix"], change["file"]
    saved, now = change["saved"], change["now"]
    if change["change"] == "removed":
        return f"prefix {prefix} ({file}, checksum {saved}) is no longer in data.paths"
    if change["change"] == "added":
        return f"prefix {prefix} ({file}, checksum {now}) was not in the checkpoint's corpus"
    if change["change"] == "missing":
        return f"prefix {prefix}: {file} is missing (the checkpoint recorded checksum {saved})"
    return f"prefix {prefix}: {file} has checksum {now}, the checkpoint recorded {saved}"
