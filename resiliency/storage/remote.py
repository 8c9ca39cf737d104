"""The object-store tier: committed steps copied to S3 by an uploader independent of training,
and restored from when no local, replica or shared step verifies.

Remote layout under ``<url>`` (s3://bucket/prefix)::

    <run_id>/steps/step-000000100/<every payload file of the step>   immutable objects
    <run_id>/steps/step-000000100/manifest.json                      after every payload object
    <run_id>/steps/step-000000100/COMMITTED                          last: the manifest's checksum
    <run_id>/latest.json                                             a hint, moved forward only

A step is on the remote tier only once COMMITTED exists, and COMMITTED is written only after
every object is there with the manifest's size and checksum (in its metadata; the server checked
each PUT's Content-MD5). Objects are created with If-None-Match: an upload never overwrites,
and a restarted one skips what already verifies. latest.json is replaced with If-Match on the
version read, so two uploaders cannot move it backwards. A restore re-checks COMMITTED against
the manifest, and every downloaded file against the manifest's checksum, before it publishes
the step locally through the usual protocol.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from resiliency.storage.checksum import FileEntry, file_checksum
from resiliency.storage.layout import (
    COMMITTED_NAME,
    MANIFEST_NAME,
    RunLayout,
    fsync_tree,
    parse_step,
    step_name,
    write_durable,
)
from resiliency.storage.lease import GenerationPin, LeaseLostError
from resiliency.storage.manifest import Manifest, ManifestError, manifest_checksum
from resiliency.storage.object_store import ObjectStore, PreconditionFailed
from resiliency.storage.publish import begin_step, publish, set_aside
from resiliency.storage.signing import SigningKey, parse_marker, signature_problem
from resiliency.storage.verify import verify_step_dir

log = logging.getLogger(__name__)
LATEST = "latest.json"


class UploadError(Exception):
    """A step cannot be uploaded as the protocol requires."""


@dataclass(frozen=True)
class UploadReport:
    step: int
    sent: int  # objects written
    skipped: int  # objects already there and verified (a resumed upload), or the whole step
    bytes_sent: int
    seconds: float


@dataclass(frozen=True)
class RemoteVerdict:
    ok: bool
    step: int
    reason: str
    manifest: Manifest | None = None


def step_prefix(run_id: str, step: int) -> str:
    return f"{run_id}/steps/{step_name(step)}/"


def remote_steps(store: ObjectStore, run_id: str) -> list[int]:
    """Steps with any object on the remote tier (committed or not), ascending. Listed object by
    object: stores with real directories (SeaweedFS's filer) keep an emptied step's prefix."""
    start = len(f"{run_id}/steps/")
    names = {key[start:].split("/", 1)[0] for key in store.list(f"{run_id}/steps/")}
    return sorted(s for s in map(parse_step, names) if s is not None)


def upload_step(store: ObjectStore, step_dir: Path, run_id: str, workers: int) -> UploadReport:
    """Copy one published, verified local step; objects already there and verified are kept."""
    started = time.perf_counter()
    verdict = verify_step_dir(step_dir, run_id, full=True)
    if not verdict.ok or verdict.manifest is None:
        raise UploadError(f"{step_dir} does not verify ({verdict.reason}): not uploaded")
    manifest, base = verdict.manifest, step_prefix(run_id, verdict.manifest.step)
    committed = (step_dir / COMMITTED_NAME).read_bytes()
    remote_commit = store.get_bytes(base + COMMITTED_NAME)
    if remote_commit is not None:
        if remote_commit[0] != committed:
            raise UploadError(f"{store.url}/{base} is committed with another manifest")
        return UploadReport(manifest.step, 0, len(manifest.files) + 2, 0, 0.0)
    with ThreadPoolExecutor(workers, thread_name_prefix="upload") as pool:
        sent = list(pool.map(lambda e: _upload_file(store, base, step_dir, e), manifest.files))
    _put_same(store, base + MANIFEST_NAME, (step_dir / MANIFEST_NAME).read_bytes())
    _put_same(store, base + COMMITTED_NAME, committed)  # last: the step now exists remotely
    count = sum(1 for n in sent if n is not None)
    return UploadReport(
        manifest.step,
        count + 2,
        len(sent) - count,
        sum(n for n in sent if n is not None),
        time.perf_counter() - started,
    )


def _upload_file(store: ObjectStore, base: str, step_dir: Path, entry: FileEntry) -> int | None:
    """Bytes sent, or None when the object was there with this size and checksum already."""
    rel = base + entry.path
    if (info := store.head(rel)) is not None:
        if _matches(info.size, info.metadata, entry):
            return None
        raise UploadError(
            f"{store.url}/{rel} exists with other content, and remote objects are never "
            f"overwritten: delete the uncommitted remote step {base} and upload again"
        )
    metadata = {"checksum": entry.checksum, "algorithm": entry.algorithm}
    try:
        store.put_file(rel, step_dir / entry.path, metadata)
    except PreconditionFailed:  # another uploader of this step got there first
        pass
    info = store.head(rel)
    if info is None or not _matches(info.size, info.metadata, entry):
        raise UploadError(f"{store.url}/{rel} does not hold {entry.path} after its upload")
    return entry.bytes


def _matches(size: int, metadata: dict[str, str], entry: FileEntry) -> bool:
    return size == entry.bytes and metadata.get("checksum") == entry.checksum


def _put_same(store: ObjectStore, rel: str, data: bytes) -> None:
    """Create ``rel`` with ``data``; an existing object must hold the same bytes."""
    try:
        store.put_bytes(rel, data)
    except PreconditionFailed:
        existing = store.get_bytes(rel)
        if existing is None or existing[0] != data:
            raise UploadError(f"{store.url}/{rel} exists with other content") from None


def advance_latest(store: ObjectStore, run_id: str, step: int) -> bool:
    """Point latest.json at ``step`` unless it already names this step or a later one; the
    write is conditional on the version read, so racing uploaders never move it backwards."""
    rel = f"{run_id}/{LATEST}"
    body = json.dumps({"step": step, "dir": f"steps/{step_name(step)}"}).encode()
    while True:
        current = store.get_bytes(rel)
        if current is not None and int(json.loads(current[0])["step"]) >= step:
            return False
        try:
            store.put_bytes(rel, body, if_match=current[1] if current else None)
            return True
        except PreconditionFailed:
            continue  # someone else moved it: read again


def read_latest(store: ObjectStore, run_id: str) -> int | None:
    current = store.get_bytes(f"{run_id}/{LATEST}")
    return None if current is None else int(json.loads(current[0])["step"])


def verify_remote_step(
    store: ObjectStore, run_id: str, step: int, full: bool, key: SigningKey | None = None
) -> RemoteVerdict:
    """COMMITTED names the manifest, and every object has the manifest's size and checksum
    (``full``: downloaded and re-hashed, not only its recorded metadata); with ``key`` the
    manifest carries its HMAC under it."""
    base = step_prefix(run_id, step)
    marker = store.get_bytes(base + COMMITTED_NAME)
    if marker is None:
        return RemoteVerdict(False, step, "no COMMITTED (an upload that did not finish)")
    raw = store.get_bytes(base + MANIFEST_NAME)
    checksum, signature = parse_marker(marker[0].decode(errors="replace"))
    if raw is None or manifest_checksum(raw[0]) != checksum:
        return RemoteVerdict(False, step, "manifest.json missing or not the one COMMITTED names")
    if (problem := signature_problem(raw[0], signature, key)) is not None:
        return RemoteVerdict(False, step, problem)
    try:
        manifest = Manifest.from_json(raw[0])
    except ManifestError as exc:
        return RemoteVerdict(False, step, f"manifest: {exc}")
    if manifest.run_id != run_id or manifest.step != step:
        return RemoteVerdict(False, step, f"manifest is {manifest.run_id} step {manifest.step}")
    for entry in manifest.files:
        if (problem := _object_problem(store, base, entry, full)) is not None:
            return RemoteVerdict(False, step, problem)
    kind = "full" if full else "quick"
    return RemoteVerdict(True, step, f"ok ({kind}: {len(manifest.files)} objects)", manifest)


def _object_problem(store: ObjectStore, base: str, entry: FileEntry, full: bool) -> str | None:
    info = store.head(base + entry.path)
    if info is None:
        return f"{entry.path}: missing"
    if not _matches(info.size, info.metadata, entry):
        return f"{entry.path}: size or checksum differs from the manifest"
    if full:
        with tempfile.TemporaryDirectory() as tmp:
            local = Path(tmp) / "object"
            store.download(base + entry.path, local)
            if file_checksum(local, entry.algorithm) != entry.checksum:
                return f"{entry.path}: content does not match its checksum"
    return None


def fetch_step(
    store: ObjectStore,
    layout: RunLayout,
    step: int,
    attempt: int,
    workers: int,
    key: SigningKey | None = None,
) -> Path | None:
    """Download a remote step into the run's steps dir and publish it there, every file
    checked against the manifest on the way (and, with ``key``, the manifest's signature
    first); None (nothing left behind) if any is not."""
    verdict = verify_remote_step(store, layout.run_id, step, full=False, key=key)
    if not verdict.ok or verdict.manifest is None:
        log.warning("remote: step %d skipped: %s", step, verdict.reason)
        return None
    if layout.step_dir(step).exists():
        set_aside(layout, step, "replaced by the remote tier's copy")
    base, tmp = step_prefix(layout.run_id, step), begin_step(layout, step, attempt)
    try:
        with ThreadPoolExecutor(workers, thread_name_prefix="fetch") as pool:
            problems = list(pool.map(lambda e: _fetch_file(store, base, tmp, e),
                                     verdict.manifest.files))  # fmt: skip
        if any(problems):
            raise UploadError(next(p for p in problems if p))
        for name in (MANIFEST_NAME, COMMITTED_NAME):
            got = store.get_bytes(base + name)
            assert got is not None
            write_durable(tmp / name, got[0])
        fsync_tree(tmp)
        # What was written is verified like any step (the marker and signature included)
        # before it is published: the objects could have changed since the check above.
        written = verify_step_dir(tmp, layout.run_id, full=False, key=key)
        if not written.ok:
            raise UploadError(written.reason)
        return publish(layout, tmp, step)
    except (UploadError, OSError) as exc:
        log.warning("remote: step %d rejected: %s", step, exc)
        shutil.rmtree(tmp, ignore_errors=True)
        return None


def _fetch_file(store: ObjectStore, base: str, tmp: Path, entry: FileEntry) -> str | None:
    path = tmp / entry.path
    path.parent.mkdir(parents=True, exist_ok=True)
    store.download(base + entry.path, path)
    if path.stat().st_size != entry.bytes or file_checksum(path, entry.algorithm) != entry.checksum:
        return f"{entry.path}: downloaded content does not match the manifest"
    return None


def fetch_newest(
    store: ObjectStore,
    layout: RunLayout,
    attempt: int,
    workers: int,
    below: int | None = None,
    committed: list[int] | None = None,
    key: SigningKey | None = None,
) -> Path | None:
    """The newest remote step (below ``below``; of ``committed``, when the caller listed them
    already) that verifies and downloads intact, published into the run's steps dir; None if
    there is none."""
    if committed is None:
        committed = committed_remote_steps(store, layout.run_id)
    for step in reversed(committed):
        if below is not None and step >= below:
            continue
        started = time.perf_counter()
        if (path := fetch_step(store, layout, step, attempt, workers, key)) is not None:
            log.info("remote: fetched step %d from %s (%.1f s)", step, store.url,
                     time.perf_counter() - started)  # fmt: skip
            return path
    return None


def upload_run(
    store: ObjectStore, layout: RunLayout, workers: int, keep_last: int,
    milestone_interval: int | None = None, pin: GenerationPin | None = None,
) -> list[UploadReport]:  # fmt: skip
    """Upload every published local step the remote tier lacks (oldest first), move latest.json
    forward, then apply the remote retention; with ``pin``, deletes only while the lease is
    still the generation this uploader serves (else LeaseLostError, nothing deleted)."""
    done = set(committed_remote_steps(store, layout.run_id))
    reports = []
    for step in layout.published_steps():
        if step in done:
            continue
        try:
            report = upload_step(store, layout.step_dir(step), layout.run_id, workers)
        except UploadError as exc:
            if not layout.step_dir(step).exists():  # collected locally meanwhile: nothing lost
                continue
            raise UploadError(f"step {step}: {exc}") from None
        reports.append(report)
        advance_latest(store, layout.run_id, step)
        log.info("remote: step %d uploaded to %s (%d objects sent, %d already there, "
                 "%.1f MiB, %.2f s)", step, store.url, report.sent, report.skipped,
                 report.bytes_sent / 2**20, report.seconds)  # fmt: skip
    if pin is not None and (problem := pin.problem()) is not None:
        raise LeaseLostError(f"remote retention refused: {problem}")
    apply_remote_retention(store, layout.run_id, keep_last, milestone_interval)
    return reports


def committed_remote_steps(store: ObjectStore, run_id: str) -> list[int]:
    return [s for s in remote_steps(store, run_id)
            if store.head(step_prefix(run_id, s) + COMMITTED_NAME) is not None]  # fmt: skip


def apply_remote_retention(
    store: ObjectStore, run_id: str, keep_last: int, milestone_interval: int | None
) -> list[int]:
    """Delete committed steps beyond the newest ``keep_last`` (milestones kept), and abandoned
    partial uploads older than the oldest kept step; COMMITTED goes first, so a half-deleted
    step never looks complete. Only ever after a newer step is committed remotely."""
    committed = committed_remote_steps(store, run_id)
    if len(committed) <= keep_last:
        return []
    kept = set(committed[-keep_last:])
    kept |= {s for s in committed if milestone_interval and s % milestone_interval == 0}
    oldest_kept = min(kept)
    doomed = [s for s in remote_steps(store, run_id)
              if s not in kept and (s in committed or s < oldest_kept)]  # fmt: skip
    for step in doomed:
        base = step_prefix(run_id, step)
        store.delete(base + COMMITTED_NAME)
        for rel in store.list(base):
            store.delete(rel)
        log.info("remote retention: deleted step %d from %s", step, store.url)
    return doomed
