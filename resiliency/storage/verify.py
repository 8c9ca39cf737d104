"""Decide whether a step dir is a complete, intact checkpoint of this run."""

from __future__ import annotations

import errno
import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from resiliency.storage.checksum import ALGORITHMS, FileEntry, file_checksum
from resiliency.storage.layout import (
    COMMITTED_NAME,
    MODEL_DIR,
    RESERVED_NAMES,
    TRAIN_STATE_NAME,
    parse_step,
    parse_tmp,
    payload_files,
)
from resiliency.storage.manifest import (
    Manifest,
    ManifestError,
    manifest_checksum,
    read_manifest,
    read_manifest_bytes,
)
from resiliency.storage.pickle_scan import step_pickle_problem
from resiliency.storage.signing import (
    SigningKey,
    binding_problem,
    parse_marker,
    signature_problem,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Verdict:
    ok: bool
    step: int | None
    reason: str
    manifest: Manifest | None = field(default=None, compare=False, repr=False)


def _bad(step: int | None, reason: str) -> Verdict:
    return Verdict(False, step, reason)


def step_of_dir(step_dir: Path) -> int | None:
    """Step encoded in a published or tmp dir name."""
    step = parse_step(step_dir.name)
    if step is None and (tmp := parse_tmp(step_dir.name)) is not None:
        step = tmp[0]
    return step


def expected_run_id(step_dir: Path, asked: str | None = None) -> tuple[str, str | None]:
    """The run id a step read on its own is checked against: ``asked`` (``--run-id``), else
    the one its manifest records (a copied or renamed run keeps its steps' identity), else its
    run dir's name; with a note when the manifest and the directory disagree."""
    dir_name = step_dir.absolute().parent.parent.name
    if asked is not None:
        return asked, None
    try:
        recorded = read_manifest(step_dir).run_id
    except (ManifestError, ValueError, KeyError, TypeError):
        return dir_name, None  # verification names what is wrong with the manifest
    note = (
        (
            f"{step_dir} records run {recorded!r}, its run dir is named {dir_name!r} (a copied "
            f"run?): checked as run {recorded!r}; give --run-id to demand another"
        )
        if recorded != dir_name
        else None
    )
    return recorded, note


def verify_step_dir(
    step_dir: Path, run_id: str, full: bool = True, key: SigningKey | None = None
) -> Verdict:
    """Check marker, manifest identity and every listed file; ``full`` also re-hashes the data.
    With ``key`` the manifest must carry its HMAC under that key (without one a signature is
    neither required nor looked at)."""
    step_dir = Path(step_dir)
    step = step_of_dir(step_dir)
    if step is None:
        return _bad(None, f"{step_dir.name!r} is not a step dir name")
    if not step_dir.is_dir():
        return _bad(step, f"{step_dir} does not exist or is not a directory")
    try:
        manifest = _read_committed_manifest(step_dir, key)
    except ManifestError as e:
        return _bad(step, str(e))
    if (problem := _identity_problem(manifest, run_id, step)) is not None:
        return _bad(step, problem)
    if (problem := check_files(step_dir, manifest.files, full)) is not None:
        return _bad(step, problem)
    # full: what unpickling the step would import, found without unpickling it
    if full and (problem := step_pickle_problem(step_dir, [e.path for e in manifest.files])):
        return _bad(step, problem)
    if (problem := _train_state_problem(step_dir, manifest.files, step)) is not None:
        return _bad(step, problem)
    kind = "full" if full else "quick"
    return Verdict(
        True,
        step,
        f"ok ({kind}: {len(manifest.files)} files, {manifest.total_bytes} bytes)",
        manifest,
    )


def _read_committed_manifest(step_dir: Path, key: SigningKey | None = None) -> Manifest:
    marker = step_dir / COMMITTED_NAME
    try:
        committed, signature = parse_marker(marker.read_text())
    except FileNotFoundError as e:
        raise ManifestError(f"no {COMMITTED_NAME} marker (the save never finished)") from e
    except (OSError, UnicodeDecodeError) as e:
        raise ManifestError(f"{COMMITTED_NAME} is unreadable: {e}") from e
    raw = read_manifest_bytes(step_dir)
    expected = manifest_checksum(raw)
    if committed != expected:
        raise ManifestError(
            f"{COMMITTED_NAME} says {committed[:40]!r} but manifest.json hashes "
            f"to {expected!r} (marker belongs to another manifest)"
        )
    if (problem := signature_problem(raw, signature, key)) is not None:
        raise ManifestError(problem)
    manifest = Manifest.from_json(raw)
    if (problem := binding_problem((e.algorithm for e in manifest.files), key)) is not None:
        raise ManifestError(problem)
    return manifest


def _identity_problem(manifest: Manifest, run_id: str, step: int) -> str | None:
    if manifest.run_id != run_id:
        return (
            f"manifest run_id {manifest.run_id!r} != expected {run_id!r} "
            f"(checkpoint from another run)"
        )
    if manifest.step != step:
        return f"manifest step {manifest.step} != step {step} in the directory name"
    return None


def _train_state_problem(step_dir: Path, files: list[FileEntry], step: int) -> str | None:
    """The step the loop resumes at is the one the directory and manifest name."""
    if TRAIN_STATE_NAME not in {e.path for e in files}:
        return None
    try:
        saved = json.loads((step_dir / TRAIN_STATE_NAME).read_text()).get("step")
    except (OSError, ValueError, AttributeError) as e:
        return f"{TRAIN_STATE_NAME} is unreadable: {e}"
    if saved != step:
        return f"{TRAIN_STATE_NAME} says step {saved!r}, the directory name and manifest say {step}"
    return None


def filesystem_problem(step_dir: Path, files: list[FileEntry]) -> str | None:
    """Anything in ``step_dir`` but regular files and the directories that hold listed files:
    a symlink of any kind (to a file or a directory, inside the step or out), a special file,
    a directory the manifest does not imply. Nothing is followed."""
    listed = {e.path for e in files} | RESERVED_NAMES
    dirs = {str(parent) for p in listed for parent in PurePosixPath(p).parents} - {"."}
    pending = [(step_dir, "")]
    while pending:
        directory, prefix = pending.pop()
        with os.scandir(directory) as entries:
            for entry in entries:
                rel = f"{prefix}{entry.name}"
                if entry.is_symlink():
                    return f"{rel!r} is a symlink (a step holds regular files and directories only)"
                if entry.is_dir(follow_symlinks=False):
                    if rel not in dirs:
                        return f"unlisted directory {rel!r} (no file of the manifest is in it)"
                    pending.append((Path(entry.path), f"{rel}/"))
                elif not entry.is_file(follow_symlinks=False):
                    return f"{rel!r} is not a regular file or directory"
    return None


def check_files(step_dir: Path, files: list[FileEntry], full: bool) -> str | None:
    """First problem with the payload files of ``step_dir`` against ``files``, or None. An
    I/O error (EIO, EACCES, ESTALE in a stat, a listing or a read) is a problem like any
    other: the step is unusable for now, and the restore moves to the next older one."""
    try:
        return _check_files(step_dir, files, full)
    except OSError as exc:
        return io_problem(exc)


def io_problem(exc: OSError) -> str:
    """One line for an I/O error met while checking a step."""
    where = f" on {exc.filename}" if exc.filename else ""
    name = errno.errorcode.get(exc.errno or 0, "OSError")
    return f"I/O error{where}: {name} ({exc.strerror or exc})"


def _check_files(step_dir: Path, files: list[FileEntry], full: bool) -> str | None:
    if (problem := filesystem_problem(step_dir, files)) is not None:
        return problem
    root = step_dir.resolve()
    for entry in files:
        problem = _check_entry(root, entry, full)
        if problem is not None:
            return problem
    listed = {e.path for e in files}
    extra = [p for p in payload_files(step_dir) if p not in listed]
    if extra:
        return f"unlisted file(s) not in manifest: {', '.join(extra[:5])}"
    return None


def _unsafe_path_problem(root: Path, rel: str) -> str | None:
    pure = PurePosixPath(rel)
    if pure.is_absolute() or rel.startswith("\\") or (len(rel) > 1 and rel[1] == ":"):
        return f"manifest path {rel!r} is absolute"
    if ".." in pure.parts or "\\" in rel:
        return f"manifest path {rel!r} escapes the step dir"
    # resolve() follows symlinks, so a listed file that links outside the step dir is caught.
    if not (root / pure).resolve().is_relative_to(root):
        return f"manifest path {rel!r} resolves outside the step dir (symlink?)"
    return None


def _check_entry(root: Path, entry: FileEntry, full: bool) -> str | None:
    if (problem := _unsafe_path_problem(root, entry.path)) is not None:
        return problem
    path = root / entry.path
    try:
        st = path.stat()
    except FileNotFoundError:
        return f"listed file {entry.path!r} is missing"
    if not os.path.isfile(path):
        return f"listed file {entry.path!r} is not a regular file"
    if st.st_size != entry.bytes:
        return f"file {entry.path!r} has {st.st_size} bytes, manifest says {entry.bytes}"
    if full:
        return checksum_problem(path, entry)
    return None


def checksum_problem(path: Path, entry: FileEntry) -> str | None:
    if entry.algorithm not in ALGORITHMS:
        return f"file {entry.path!r} uses unknown checksum algorithm {entry.algorithm!r}"
    actual = file_checksum(path, entry.algorithm)
    if actual != entry.checksum:
        return (
            f"file {entry.path!r} {entry.algorithm} mismatch: {actual} != manifest {entry.checksum}"
        )
    return None


def balanced_share(files: list[FileEntry], rank: int, world_size: int) -> list[FileEntry]:
    """This rank's part of ``files`` when every rank re-hashes some (same answer on every
    rank): each rank's own shard files (torch DCP names them ``__<rank>_<n>.distcp``) go to
    that rank where it exists, since at the same layout it reads them and its read checks
    them as it goes (checkpoint/restore/share_check.py); the rest largest first, each to the
    rank with the fewest bytes so far."""
    loads = [0] * world_size
    mine, rest = [], []
    for entry in files:
        writer = _shard_writer(entry.path)
        if writer is None or writer >= world_size:
            rest.append(entry)
            continue
        loads[writer] += entry.bytes
        if writer == rank:
            mine.append(entry)
    for entry in sorted(rest, key=lambda e: (-e.bytes, e.path)):
        owner = loads.index(min(loads))
        loads[owner] += entry.bytes
        if owner == rank:
            mine.append(entry)
    return mine


_OWN_SHARD = re.compile(rf"^{MODEL_DIR}/__(\d+)_\d+\.distcp$")


def _shard_writer(rel_path: str) -> int | None:
    """The rank that wrote a shard file of the step's model dir, from its DCP name."""
    match = _OWN_SHARD.match(rel_path)
    return int(match.group(1)) if match else None
