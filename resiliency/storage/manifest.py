"""manifest.json: what a published step contains and what produced it."""

from __future__ import annotations

import functools
import json
import logging
import os
import platform
import subprocess
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

from resiliency.storage.checksum import FileEntry, bytes_checksum
from resiliency.storage.layout import MANIFEST_NAME

logger = logging.getLogger(__name__)
BUILD_COMMIT_NAME = "BUILD_COMMIT"  # written by docker/install.sh into resiliency/


SCHEMA_VERSION = 1
MANIFEST_CHECKSUM_ALGORITHM = "crc32c"
_PACKAGES = ("torch", "megatron-core", "nvidia-resiliency-ext", "mcore-recipes")
_REQUIRED_INT = ("attempt", "step", "world_size")
_DICT_FIELDS = ("parallelism", "versions", "dataset", "tokenizer", "config")


class ManifestError(Exception):
    """manifest.json is missing, unreadable or not a schema we understand."""


def utc_now_iso() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class Manifest:
    run_id: str
    attempt: int
    step: int
    world_size: int
    parallelism: dict[str, int] = field(default_factory=dict)  # tp/pp/cp/ep/vpp/dp
    optim_format: str = ""
    versions: dict[str, str | None] = field(default_factory=dict)
    code_commit: str | None = None
    image_digest: str | None = None
    dataset: dict[str, Any] = field(default_factory=dict)
    tokenizer: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    files: list[FileEntry] = field(default_factory=list)
    # No optimizer state: a step imported from transformers (restores load weights only).
    weights_only: bool = False
    # The step a warm start loaded as this run's step 0 (checkpoint.init_from): the spec, its
    # run id, step and manifest checksum, and what was loaded; carried by every later step.
    init_from: dict[str, Any] | None = None
    created_at: str = field(default_factory=utc_now_iso)
    schema_version: int = SCHEMA_VERSION

    @property
    def total_bytes(self) -> int:
        return sum(f.bytes for f in self.files)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["files"] = [f.to_dict() for f in self.files]
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    @classmethod
    def from_dict(cls, d: Any) -> Manifest:
        if not isinstance(d, dict):
            raise ManifestError("manifest is not a JSON object")
        _check_schema(d)
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in known}
        try:
            kwargs["files"] = _parse_files(d.get("files"))
        except ValueError as e:
            raise ManifestError(str(e)) from e
        return cls(**kwargs)

    @classmethod
    def from_json(cls, text: str | bytes) -> Manifest:
        try:
            d = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ManifestError(f"manifest is not valid JSON: {e}") from e
        return cls.from_dict(d)


def _check_schema(d: dict[str, Any]) -> None:
    if d.get("schema_version") != SCHEMA_VERSION:
        raise ManifestError(
            f"unsupported manifest schema_version {d.get('schema_version')!r} "
            f"(this code reads {SCHEMA_VERSION})"
        )
    if not isinstance(d.get("run_id"), str):
        raise ManifestError("manifest has no string 'run_id'")
    for key in _REQUIRED_INT:
        value = d.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ManifestError(f"manifest field {key!r} must be a non-negative int, got {value!r}")
    for key in _DICT_FIELDS:
        if not isinstance(d.get(key, {}), dict):
            raise ManifestError(f"manifest field {key!r} must be an object")


def _parse_files(raw: Any) -> list[FileEntry]:
    if not isinstance(raw, list):
        raise ValueError("manifest 'files' must be a list")
    entries = [FileEntry.from_dict(item) for item in raw]
    seen: set[str] = set()
    for e in entries:
        if e.path in seen:
            raise ValueError(f"manifest lists {e.path!r} twice")
        seen.add(e.path)
    return entries


def merge_file_entries(groups: Iterable[Iterable[FileEntry]]) -> list[FileEntry]:
    """Flatten what each rank described into one sorted list; a path claimed twice is a bug."""
    merged: dict[str, FileEntry] = {}
    for group in groups:
        for entry in group:
            if entry.path in merged and merged[entry.path] != entry:
                raise ValueError(
                    f"ranks disagree about {entry.path!r}: {merged[entry.path]} vs {entry}"
                )
            merged[entry.path] = entry
    return [merged[p] for p in sorted(merged)]


def manifest_checksum(raw: bytes) -> str:
    """The token COMMITTED holds: ties the marker to these exact manifest bytes."""
    return f"{MANIFEST_CHECKSUM_ALGORITHM}:{bytes_checksum(raw, MANIFEST_CHECKSUM_ALGORITHM)}"


def read_manifest_bytes(step_dir: Path) -> bytes:
    path = step_dir / MANIFEST_NAME
    try:
        return path.read_bytes()
    except FileNotFoundError as e:
        raise ManifestError(f"{MANIFEST_NAME} is missing") from e
    except OSError as e:
        raise ManifestError(f"{MANIFEST_NAME} is unreadable: {e}") from e


def read_manifest(step_dir: Path) -> Manifest:
    return Manifest.from_json(read_manifest_bytes(step_dir))


def runtime_versions() -> dict[str, str | None]:
    return dict(_runtime_versions())


@functools.cache
def _runtime_versions() -> dict[str, str | None]:
    # Once per process (6 ms of every save's publish): installed packages do not change
    # under a running process, and its imported modules would not follow them if they did.
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name in _PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


@functools.cache
def code_commit() -> str | None:
    """The commit this code runs from: ``$MCORE_RECIPES_CODE_COMMIT`` (set by the launchers for
    every rank), else git's HEAD of the checkout holding this file, ``-dirty`` when tracked
    files differ from it, else the commit an image build recorded beside the installed package
    (docker/install.sh), else the one pip recorded for a VCS install (PEP 610). Once per
    process: every save records the same answer."""
    env = os.environ.get("MCORE_RECIPES_CODE_COMMIT")
    if env:
        return env
    here = Path(__file__).resolve().parent
    return _git_commit(here) or _built_commit(here.parent) or _installed_commit()


def _built_commit(package: Path) -> str | None:
    try:
        commit = (package / BUILD_COMMIT_NAME).read_text().strip()
    except OSError:
        return None
    return commit if commit and commit != "unknown" else None


def _git_commit(where: Path) -> str | None:
    # git finds the work tree's root from any directory inside it.
    head = _git(where, "rev-parse", "HEAD")
    if head is None:
        return None
    dirty = _git(where, "status", "--porcelain", "--untracked-files=no")
    return f"{head}-dirty" if dirty else head


def _git(where: Path, *args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=where, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError) as e:
        logger.warning("cannot run git %s in %s: %s", args[0], where, e)
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _installed_commit() -> str | None:
    try:
        raw = metadata.distribution("mcore-recipes").read_text("direct_url.json")
        commit = json.loads(raw or "{}").get("vcs_info", {}).get("commit_id")
    except (metadata.PackageNotFoundError, ValueError, AttributeError):
        return None
    return commit if isinstance(commit, str) and commit else None


def image_digest() -> str | None:
    return os.environ.get("MCORE_RECIPES_IMAGE_DIGEST") or None
