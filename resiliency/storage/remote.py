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

Failures of the network or the server are not failures of a step: every call is retried by
object_retry.RetryPolicy, and only a size or checksum mismatch, or a missing object the manifest
names, rejects a step. A pass of the uploader skips (and reports) a local step that does not
verify or that local retention deleted mid-upload, and uploads the newer ones.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from pretrain.context.run_dir import RunDir
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
from resiliency.storage.object_store import ObjectMissing, ObjectStore, PreconditionFailed
from resiliency.storage.publish import begin_step, publish, set_aside
from resiliency.storage.signing import SigningKey, parse_marker, signature_problem
from resiliency.storage.verify import verify_step_dir

log = logging.getLogger(__name__)
LATEST = RunDir(Path(".")).latest_path.name  # the object key mirrors the run dir


class UploadError(Exception):
    """A step cannot be uploaded as the protocol requires."""


@dataclass(frozen=True)
class UploadReport:
    step: int
    sent: int  # objects written
    skipped: int  # objects already there and verified (a resumed upload), or the whole step
    bytes_sent: int
    seconds: float


@dataclass
class UploadPass:
    """One pass of the uploader: what went up, what was skipped and why."""

    reports: list[UploadReport] = field(default_factory=list)
    skipped: list[tuple[int, str]] = field(default_factory=list)  # (step, why)
    local: list[int] = field(default_factory=list)  # published local steps when it began
    committed: list[int] = field(default_factory=list)  # committed remotely after the pass
    deleted: list[int] = field(default_factory=list)  # by remote retention

    @property
    def newest_local(self) -> int | None:
        return self.local[-1] if self.local else None


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
        if current is not None and (_latest_step(current[0]) or -1) >= step:
            return False
        try:
            store.put_bytes(rel, body, if_match=current[1] if current else None)
            return True
        except PreconditionFailed:
            continue  # someone else moved it: read again


def read_latest(store: ObjectStore, run_id: str) -> int | None:
    current = store.get_bytes(f"{run_id}/{LATEST}")
    return None if current is None else _latest_step(current[0])


def _latest_step(data: bytes) -> int | None:
    """latest.json's step; None when it is not what we write (a hint only: the listing of
    committed steps decides, and the next advance replaces it)."""
    try:
        step = json.loads(data)["step"]
    except (ValueError, KeyError, TypeError):
        log.warning("remote: latest.json is not valid (%r...): ignored", data[:60])
        return None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


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
    except (UploadError, ObjectMissing, OSError) as exc:
        log.warning("remote: step %d rejected: %s", step, exc)
        shutil.rmtree(tmp, ignore_errors=True)
        return None
    except BaseException:  # the store is out (retry budget spent): not this step's fault
        shutil.rmtree(tmp, ignore_errors=True)
        raise


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
    verified: set[int] | None = None,
) -> UploadPass:  # fmt: skip
    """Upload every published local step the remote tier lacks (oldest first), move latest.json
    forward, then apply the remote retention; with ``pin``, deletes only while the lease is
    still the generation this uploader serves (else LeaseLostError, nothing deleted). A step
    that cannot go up is skipped with its reason; newer steps still go up. ``verified``:
    steps this process saw verify remotely (kept across passes, so retention re-checks none)."""
    verified = set() if verified is None else verified
    done = set(committed_remote_steps(store, layout.run_id))
    local = layout.published_steps()
    result = UploadPass(local=local)
    for step in local:
        if step in done:
            continue
        try:
            report = upload_step(store, layout.step_dir(step), layout.run_id, workers)
        except (UploadError, OSError) as exc:
            why = str(exc)
            if not layout.step_dir(step).exists():  # collected locally mid-upload: skip it
                why = f"deleted by local retention during its upload ({exc})"
            log.warning("remote: step %d not uploaded: %s", step, why)
            result.skipped.append((step, why))
            continue
        verified.add(step)  # every object was HEAD-checked against the manifest
        result.reports.append(report)
        advance_latest(store, layout.run_id, step)
        log.info("remote: step %d uploaded to %s (%d objects sent, %d already there, "
                 "%.1f MiB, %.2f s)", step, store.url, report.sent, report.skipped,
                 report.bytes_sent / 2**20, report.seconds)  # fmt: skip
    if pin is not None and (problem := pin.problem()) is not None:
        raise LeaseLostError(f"remote retention refused: {problem}")
    result.deleted = apply_remote_retention(
        store, layout.run_id, keep_last, milestone_interval, verified
    )
    result.committed = committed_remote_steps(store, layout.run_id)
    return result


def newest_remote_bytes(store: ObjectStore, run_id: str) -> int | None:
    """Bytes of the newest committed remote step (what a restore from this tier downloads);
    None when there is none or its manifest is unreadable."""
    committed = committed_remote_steps(store, run_id)
    if not committed:
        return None
    raw = store.get_bytes(step_prefix(run_id, committed[-1]) + MANIFEST_NAME)
    try:
        return Manifest.from_json(raw[0]).total_bytes if raw is not None else None
    except ManifestError:
        return None


def committed_remote_steps(store: ObjectStore, run_id: str) -> list[int]:
    return [s for s in remote_steps(store, run_id)
            if store.head(step_prefix(run_id, s) + COMMITTED_NAME) is not None]  # fmt: skip


def apply_remote_retention(
    store: ObjectStore,
    run_id: str,
    keep_last: int,
    milestone_interval: int | None,
    verified: set[int] | None = None,
) -> list[int]:
    """Keep the newest ``keep_last`` committed steps that verify remotely (HEAD of every object
    against the manifest; ``verified``: known already), every committed step newer than the
    oldest of them, and milestones; delete older committed steps and abandoned partial uploads
    older than the oldest kept step. COMMITTED goes first, so a half-deleted step never looks
    complete. Nothing is deleted until ``keep_last`` steps verify."""
    verified = set() if verified is None else verified
    committed = committed_remote_steps(store, run_id)
    if len(committed) <= keep_last:
        return []
    good: list[int] = []
    for step in reversed(committed):
        if step in verified or verify_remote_step(store, run_id, step, full=False).ok:
            verified.add(step)
            good.append(step)
            if len(good) == keep_last:
                break
    if len(good) < keep_last:
        log.warning("remote retention: only %d of the committed steps verify; nothing deleted",
                    len(good))  # fmt: skip
        return []
    kept = {s for s in committed if s >= min(good)}
    kept |= {s for s in committed if milestone_interval and s % milestone_interval == 0}
    oldest_kept = min(kept)
    doomed = [s for s in remote_steps(store, run_id)
              if s not in kept and (s in committed or s < oldest_kept)]  # fmt: skip
    for step in doomed:
        verified.discard(step)
        base = step_prefix(run_id, step)
        store.delete(base + COMMITTED_NAME)
        for rel in store.list(base):
            store.delete(rel)
        log.info("remote retention: deleted step %d from %s", step, store.url)
    return doomed
