"""Directory layout of one run's checkpoints, and durable-write helpers.

<root>/<run_id>/steps/step-000000100/            published, immutable
<root>/<run_id>/steps/step-000000100.tmp-attempt-03/   being written
"""

from __future__ import annotations

import json
import os
import re
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pretrain.context.run_dir import RunDir

STEP_DIGITS = 9
_STEP_RE = re.compile(r"^step-(\d{9})$")
_TMP_RE = re.compile(r"^step-(\d{9})\.tmp-attempt-(\d{2,})$")
TRASH_PREFIX = ".trash-"

MANIFEST_NAME = "manifest.json"
COMMITTED_NAME = "COMMITTED"
# Files the protocol itself writes into a step dir; every other file is payload that the
# manifest must list.
RESERVED_NAMES = frozenset({MANIFEST_NAME, COMMITTED_NAME})
# Rank 0's loop state (step, samples, scheduler); its step must agree with the dir and manifest.
TRAIN_STATE_NAME = "train_state.json"
MODEL_DIR = "model"  # megatron dist_checkpointing's directory inside a step


def step_name(step: int) -> str:
    if not 0 <= step < 10**STEP_DIGITS:
        raise ValueError(f"step {step} out of range [0, {10**STEP_DIGITS})")
    return f"step-{step:0{STEP_DIGITS}d}"


def parse_step(name: str) -> int | None:
    """Step of a published dir name (``step-NNNNNNNNN`` exactly), else None."""
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


def parse_tmp(name: str) -> tuple[int, int] | None:
    """(step, attempt) of a tmp dir name, else None."""
    m = _TMP_RE.match(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


@dataclass(frozen=True)
class RunLayout:
    root: Path
    run_id: str

    def __post_init__(self) -> None:
        if not self.run_id or "/" in self.run_id or self.run_id in (".", ".."):
            raise ValueError(f"invalid run_id {self.run_id!r}")
        object.__setattr__(self, "root", Path(self.root))

    @classmethod
    def from_run_dir(cls, run_dir: Path) -> RunLayout:
        run_dir = Path(run_dir).absolute()
        return cls(run_dir.parent, run_dir.name)

    @property
    def run_dir(self) -> Path:
        return self.root / self.run_id

    @property
    def dir(self) -> RunDir:
        """Every other entry of the run dir (pretrain/context/run_dir.py owns their names)."""
        return RunDir(self.run_dir)

    @property
    def steps_dir(self) -> Path:
        return self.dir.steps_dir

    @property
    def latest_path(self) -> Path:
        return self.dir.latest_path

    @property
    def attempts_dir(self) -> Path:
        return self.dir.attempts_dir

    @property
    def lease_path(self) -> Path:
        return self.dir.lease_path

    @property
    def lease_generation_path(self) -> Path:
        return self.dir.lease_generation_path

    @property
    def metrics_dir(self) -> Path:
        return self.dir.metrics_dir

    @property
    def run_json_path(self) -> Path:
        return self.dir.run_json_path

    def step_dir(self, step: int) -> Path:
        return self.steps_dir / step_name(step)

    def tmp_dir(self, step: int, attempt: int) -> Path:
        if attempt < 0:
            raise ValueError(f"attempt must be >= 0, got {attempt}")
        return self.steps_dir / f"{step_name(step)}.tmp-attempt-{attempt:02d}"

    def attempt_path(self, attempt: int) -> Path:
        return self.attempts_dir / f"attempt-{attempt:02d}.json"

    def published_steps(self) -> list[int]:
        """Steps with a dir named exactly like a published one (not verified), ascending."""
        steps = [parse_step(p.name) for p in _subdirs(self.steps_dir)]
        return sorted(s for s in steps if s is not None)

    def tmp_dirs(self) -> list[tuple[Path, int, int]]:
        """(path, step, attempt) of every in-progress dir, sorted by (step, attempt)."""
        found = []
        for p in _subdirs(self.steps_dir):
            parsed = parse_tmp(p.name)
            if parsed is not None:
                found.append((p, *parsed))
        return sorted(found, key=lambda t: (t[1], t[2]))

    def trash_dirs(self) -> list[Path]:
        return sorted(p for p in _subdirs(self.steps_dir) if p.name.startswith(TRASH_PREFIX))


def _subdirs(path: Path) -> list[Path]:
    try:
        return [p for p in path.iterdir() if p.is_dir() and not p.is_symlink()]
    except FileNotFoundError:
        return []


def payload_files(step_dir: Path) -> list[str]:
    """Relative posix paths of every file in ``step_dir`` except the protocol's own files."""
    out = []
    for dirpath, _dirs, files in os.walk(step_dir):
        for name in files:
            rel = (Path(dirpath) / name).relative_to(step_dir).as_posix()
            if rel not in RESERVED_NAMES:
                out.append(rel)
    return sorted(out)


def fsync_dir(path: Path) -> None:
    # A rename or create is durable only once the parent directory's entry is flushed.
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """fsync every file and directory under ``path`` bottom-up, then ``path`` itself."""
    for dirpath, _dirs, files in os.walk(path, topdown=False):
        for name in files:
            file_path = Path(dirpath) / name
            if not file_path.is_symlink():
                fsync_file(file_path)
        fsync_dir(Path(dirpath))


def write_durable(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` (created or truncated) and fsync the file, not the dir."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()


def _temp_sibling(path: Path) -> Path:
    # Same directory as the target so os.replace/os.link stay within one filesystem (atomic).
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def atomic_write_json(path: Path, obj: Any) -> None:
    """Replace ``path`` with ``obj`` as JSON so readers see the old or the new file, never a mix."""
    tmp = _temp_sibling(path)
    try:
        write_durable(tmp, json_bytes(obj))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def exclusive_write_json(path: Path, obj: Any) -> bool:
    """Create ``path`` with ``obj`` only if it does not exist; False if it already did.

    The content is written to a temp file first and then hard-linked into place: link() fails
    atomically when the name exists, so readers never see a half-written file and two writers
    can never both succeed.
    """
    tmp = _temp_sibling(path)
    try:
        write_durable(tmp, json_bytes(obj))
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)
    return True
