"""The tokenizer travels with every checkpoint: its files in ``<step>/tokenizer/``, their
checksums in the manifest's ``tokenizer.files``.

A checkpoint is only usable with the tokenizer it was trained with; recording a name or a path
is not enough (a path is re-pointed, a file regenerated with other merges, and the vocabulary
size stays the same). Each published step carries the files (kilobytes to a few MB against
GBs of state), verified like every other file of the step, so an export or a copy elsewhere
needs nothing else; a restore compares the running tokenizer's files with them, byte for byte
through their checksums, and refuses with the difference.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from pathlib import Path

from resiliency.storage.checksum import DEFAULT_ALGORITHM, FileEntry, file_checksum

TOKENIZER_DIR = "tokenizer"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack")


def tokenizer_sources(path: str | None) -> list[Path]:
    """The files that make the tokenizer at ``path``: the file itself, or the regular files of
    the directory (not hidden, not nested); none for a tokenizer without files (bytes)."""
    if not path:
        return []
    source = Path(path)
    if source.is_file():
        return [source]
    if source.is_dir():
        return sorted(
            p
            for p in source.iterdir()
            if p.is_file() and not p.name.startswith(".") and not _is_weights(p.name)
        )
    return []


def _is_weights(name: str) -> bool:
    """A model's weights beside its tokenizer (a transformers model directory): not copied."""
    return name.endswith(WEIGHT_SUFFIXES) or name.endswith(
        (".safetensors.index.json", ".bin.index.json")
    )


def copy_tokenizer(step_dir: Path, path: str | None) -> None:
    """Copy the tokenizer's files into ``step_dir/tokenizer`` (checksummed with the step's other
    files; :func:`tokenizer_record` reads their checksums back from the manifest entries)."""
    files = tokenizer_sources(path)
    if not files:
        return
    target = step_dir / TOKENIZER_DIR
    target.mkdir(exist_ok=True)
    for source in files:
        shutil.copyfile(source, target / source.name)


def tokenizer_record(entries: Iterable[FileEntry]) -> dict[str, str]:
    """name -> "algorithm:checksum" of the step's tokenizer copies, from its file entries."""
    prefix = f"{TOKENIZER_DIR}/"
    return {
        e.path[len(prefix) :]: f"{e.algorithm}:{e.checksum}"
        for e in entries
        if e.path.startswith(prefix)
    }


def tokenizer_difference(saved: dict[str, str], path: str | None) -> str | None:
    """What differs between a checkpoint's tokenizer files (:func:`tokenizer_record`) and the
    files at ``path``; None when they are the same files."""
    current = {}
    for source in tokenizer_sources(path):
        algorithm = saved.get(source.name, DEFAULT_ALGORITHM).split(":", 1)[0]
        current[source.name] = f"{algorithm}:{file_checksum(source, algorithm)}"
    if current == saved:
        return None
    problems = [
        f"{name}: {'missing here' if name not in current else 'not in the checkpoint'}"
        for name in sorted(set(saved) ^ set(current))
    ]
    problems += [
        f"{name}: content differs ({saved[name]} saved, {current[name]} here)"
        for name in sorted(set(saved) & set(current))
        if saved[name] != current[name]
    ]
    return "; ".join(problems)
