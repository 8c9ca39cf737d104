"""Node-local checkpoint files: nvidia-resiliency-ext's LocalCheckpointManager, made verifiable.

Each file (a rank's own shard or a peer's replica) gets a sidecar written before the file is
renamed into place: its crc32c and size, computed while ``torch.save`` streams the bytes out,
and the signature of the run that wrote it (run id, world size, parallel layout). Only files
whose sidecar matches (and, with checkpoint.signing_key_env, carries the file's sha256 and the
sidecar's HMAC under that key) count as available, so ``find_latest`` (collective) picks the
newest step that every rank can assemble from verified copies. A file that fails verification
is renamed ``*.rejected`` and logged once: it is never offered again (Megatron-LM #5281: a
corrupt replica caused 44 restart cycles). Files are not fsynced: the tier protects against
process and node loss, a torn file after a kernel crash fails its checksum and the replica or
persistent tier takes over.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.base_manager import (
    SameMachineReplicationException,
)
from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager import (
    LocalCheckpointManager,
)

from pretrain.platform.compat import safe_torch_load
from resiliency.storage.checksum import ChecksummingStream, file_checksum
from resiliency.storage.layout import atomic_write_json
from resiliency.storage.pickle_scan import file_pickle_problem
from resiliency.storage.signing import SIGNED_ALGORITHM, SigningKey, record_problem, sign_record

log = logging.getLogger(__name__)
META_SUFFIX = ".meta.json"
REJECTED_SUFFIX = ".rejected"
RESTORING_NAME = "restoring.json"
_FILE_RE = re.compile(r"iter_(\d+)_(\d+)_local(\.dirty)?\.pt")


@dataclass(frozen=True)
class LocalFile:
    path: Path
    step: int
    owner: int
    dirty: bool

    @property
    def meta_path(self) -> Path:
        return self.path.with_name(self.path.name + META_SUFFIX)


def parse_local_file(path: Path) -> LocalFile | None:
    match = _FILE_RE.fullmatch(path.name)
    if match is None:
        return None
    return LocalFile(path, int(match[1]), int(match[2]), bool(match[3]))


def list_local_files(rank_dir: Path) -> list[LocalFile]:
    if not rank_dir.is_dir():
        return []
    found = (parse_local_file(p) for p in rank_dir.iterdir() if p.is_file())
    return sorted((f for f in found if f is not None), key=lambda f: (f.step, f.owner))


def read_meta(entry: LocalFile) -> dict[str, Any] | None:
    """The file's sidecar (checksum, size, signature), or None when missing or unreadable."""
    try:
        meta = json.loads(entry.meta_path.read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def content_problem(entry: LocalFile, meta: dict[str, Any], signed: bool = False) -> str | None:
    """None if the file's bytes match its sidecar, else what is wrong; ``signed``: by the
    sha256 a signed sidecar binds them with (crc32c can be matched by an edit)."""
    size = entry.path.stat().st_size
    if size != meta.get("bytes"):
        return f"size {size} != recorded {meta.get('bytes')} (truncated or overwritten)"
    algorithm = SIGNED_ALGORITHM if signed else "crc32c"
    actual = file_checksum(entry.path, algorithm)
    if actual != meta.get(algorithm):
        return f"{algorithm} {actual} != recorded {meta.get(algorithm)} (corrupt)"
    # A sidecar can be rewritten as easily as the file: what loading it would run is checked too.
    return file_pickle_problem(entry.path, entry.path.name)


class VerifiedLocalManager(LocalCheckpointManager):
    """LocalCheckpointManager whose files carry checksums and whose cleanup keeps N steps."""

    def __init__(
        self,
        node_dir: Path,
        run_id: str,
        signature: dict[str, Any],
        keep_last: int,
        repl_strategy: Any = None,
        key: SigningKey | None = None,
    ) -> None:
        super().__init__(node_dir, session_id=run_id, repl_strategy=repl_strategy)
        self.signature, self.keep_last = signature, keep_last
        self.key = key  # checkpoint.signing_key_env: sidecars are signed, and must be
        self._trusted: dict[str, tuple[int, int]] = {}  # name -> (size, mtime_ns) verified

    @property
    def rank_dir(self) -> Path:
        return Path(self.local_ckpt_dir)

    # --------------------------------------------------------- nvrx hooks
    def _save(self, state_dict: Any, ckpt_id: Any) -> None:
        self._ensure_dir()
        dirty = self._local_ckpt_path_from_id(ckpt_id, True)
        final = self._local_ckpt_path_from_id(ckpt_id, False)
        try:
            with open(dirty, "xb") as stream:
                # Kept in the page cache: this tier is for restores at memory speed on this node.
                writer = ChecksummingStream(stream, drop_behind=False)
                torch.save(state_dict, writer)  # nosec B614 - our own files, loaded by nvrx
        except FileExistsError as exc:
            raise SameMachineReplicationException(ckpt_id) from exc
        checksum = writer.checksum if writer.valid else file_checksum(dirty)
        meta = {
            "step": ckpt_id[0],
            "owner_rank": ckpt_id[1],
            "holder_rank": self.rank,
            "bytes": dirty.stat().st_size,
            "crc32c": checksum,
            "signature": self.signature,
        }
        if self.key is not None:
            meta[SIGNED_ALGORITHM] = file_checksum(dirty, SIGNED_ALGORITHM)
        meta = sign_record(meta, self.key)
        atomic_write_json(final.with_name(final.name + META_SUFFIX), meta)
        dirty.rename(final)
        self._trust(final)

    def _load(self, ckpt_id: Any) -> Any:
        """nvrx loads with ``torch.load(weights_only=False)``: this admits the allow-list only."""
        path = self._local_ckpt_path_from_id(ckpt_id)
        if not path.is_file():
            return super()._load(ckpt_id)  # nvrx's own missing-file error
        return safe_torch_load(path, str(path))

    def _my_ckpt_ids(self) -> list[Any]:
        """Available = verified against the sidecar; failures are set aside, never retried."""
        self._ensure_dir()
        ids = []
        for entry in list_local_files(self.rank_dir):
            if entry.dirty:
                continue
            if self._is_trusted(entry.path) or self._verify(entry):
                ids.append((entry.step, entry.owner, self.session_id))
        return ids

    def _cleanup(self, iteration: int) -> None:
        """Keep the newest ``keep_last`` complete steps up to ``iteration``; drop the rest."""
        steps = sorted(
            {
                f.step
                for f in list_local_files(self.rank_dir)
                if not f.dirty and f.step <= iteration
            },
            reverse=True,
        )
        keep = set(steps[: self.keep_last])
        self._remove(lambda f: f.dirty or (f.step <= iteration and f.step not in keep))

    def _cleanup_failed_save(self, iteration: int) -> None:
        self._remove(lambda f: f.step == iteration)

    # ------------------------------------------------------------ ours
    def discard_after(self, step: int) -> None:
        """Files newer than the restored step belong to an abandoned timeline; dirty = dead."""
        self._remove(lambda f: f.dirty or f.step > step)
        self.latest_iteration = -1

    def reject_step(self, step: int, reason: str) -> None:
        for entry in list_local_files(self.rank_dir):
            if entry.step == step:
                self._reject(entry, reason)
        self.latest_iteration = -1

    def signature_problem(self) -> str | None:
        """Why this rank's newest local files cannot serve this run, if they cannot."""
        for entry in reversed(list_local_files(self.rank_dir)):
            meta = read_meta(entry)
            if meta is None:
                continue  # rejected at verification
            if meta.get("signature") != self.signature:
                return describe_signature_change(meta.get("signature") or {}, self.signature)
            return None
        return None

    def mark_restoring(self, step: int, attempt: int) -> None:
        self._ensure_dir()
        atomic_write_json(self.rank_dir / RESTORING_NAME, {"step": step, "attempt": attempt})

    def clear_restoring(self) -> None:
        (self.rank_dir / RESTORING_NAME).unlink(missing_ok=True)

    def failed_restore(self) -> int | None:
        """A step whose restore started in an earlier attempt and never finished."""
        try:
            return int(json.loads((self.rank_dir / RESTORING_NAME).read_text())["step"])
        except (OSError, ValueError, KeyError):
            return None

    # -------------------------------------------------------- helpers
    def _verify(self, entry: LocalFile) -> bool:
        meta = read_meta(entry)
        if meta is not None and meta.get("signature") != self.signature:
            return False  # another run's or topology's file: not corrupt, just not ours to use
        problem = (
            "no readable checksum sidecar"
            if meta is None
            else record_problem(meta, self.key)
            or content_problem(entry, meta, signed=self.key is not None)
        )
        if problem is not None:
            self._reject(entry, problem)
            return False
        self._trust(entry.path)
        return True

    def _reject(self, entry: LocalFile, reason: str) -> None:
        log.warning(
            "local checkpoint %s rejected: %s; renamed *%s, it will not be tried again",
            entry.path,
            reason,
            REJECTED_SUFFIX,
        )
        for path in (entry.path, entry.meta_path):
            if path.exists():
                path.rename(path.with_name(path.name + REJECTED_SUFFIX))
        self._trusted.pop(entry.path.name, None)

    def _trust(self, path: Path) -> None:
        stat = path.stat()
        self._trusted[path.name] = (stat.st_size, stat.st_mtime_ns)

    def _is_trusted(self, path: Path) -> bool:
        stat = path.stat()
        return self._trusted.get(path.name) == (stat.st_size, stat.st_mtime_ns)

    def _remove(self, doomed: Any) -> None:
        for entry in list_local_files(self.rank_dir):
            if doomed(entry):
                for path in (entry.path, entry.meta_path):
                    path.unlink(missing_ok=True)
                self._trusted.pop(entry.path.name, None)
        for meta in self.rank_dir.glob("*" + META_SUFFIX):  # sidecars of removed files
            if not meta.with_name(meta.name[: -len(META_SUFFIX)]).exists():
                meta.unlink(missing_ok=True)


def describe_signature_change(saved: dict[str, Any], current: dict[str, Any]) -> str:
    diffs = [
        f"{key}: {saved.get(key)!r} -> {current.get(key)!r}"
        for key in sorted(set(saved) | set(current))
        if saved.get(key) != current.get(key)
    ]
    return "saved with a different run/topology (" + "; ".join(diffs) + ")"


def node_rank() -> int:
    """The launcher's node index: torchrun/ft_launcher GROUP_RANK, else Slurm's node id."""
    for name in ("GROUP_RANK", "SLURM_NODEID"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


def ranks_per_node(world_size: int) -> int:
    value = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(value) if value.isdigit() else world_size
