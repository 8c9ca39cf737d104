"""Commit a fully written tmp step dir and publish it under its final, immutable name.

Order matters for crash safety: payload fsynced -> manifest.json -> COMMITTED -> rename to the
final name -> latest.json. A crash before the rename leaves only a tmp dir (never restored from);
a crash after it leaves a published dir that latest.json may not point to yet (the scan finds it).
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import time
from pathlib import Path

from resiliency.storage.layout import (
    COMMITTED_NAME,
    MANIFEST_NAME,
    RunLayout,
    atomic_write_json,
    fsync_dir,
    fsync_tree,
    parse_tmp,
    step_name,
    write_durable,
)
from resiliency.storage.lease import RunLease
from resiliency.storage.manifest import Manifest, read_manifest
from resiliency.storage.signing import SigningKey, marker_text
from resiliency.storage.verify import check_files, step_of_dir, verify_step_dir

logger = logging.getLogger(__name__)


class PublishError(Exception):
    """The step cannot be committed or published as asked."""


def begin_step(layout: RunLayout, step: int, attempt: int) -> Path:
    """Create an empty tmp dir for ``step``; leftovers of this attempt's earlier try are removed."""
    if layout.step_dir(step).exists():
        raise PublishError(
            f"{layout.step_dir(step)} is already published; published steps are immutable"
        )
    tmp = layout.tmp_dir(step, attempt)
    if tmp.exists():
        logger.warning("removing leftover %s from an earlier try of this attempt", tmp)
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    fsync_dir(layout.steps_dir)
    return tmp


def write_manifest_and_commit(
    tmp_dir: Path, manifest: Manifest, key: SigningKey | None = None
) -> None:
    """Write manifest.json and then COMMITTED (holding the manifest's checksum and, with
    ``key``, its HMAC: the marker and the signature appear together), both durable."""
    if step_of_dir(tmp_dir) != manifest.step:
        raise PublishError(f"manifest step {manifest.step} does not match dir {tmp_dir.name}")
    marker = tmp_dir / COMMITTED_NAME
    # A retry must never leave an old marker next to a new manifest, even for a moment.
    marker.unlink(missing_ok=True)
    if (problem := check_files(tmp_dir, manifest.files, full=False)) is not None:
        raise PublishError(f"refusing to commit {tmp_dir}: {problem}")
    raw = manifest.to_json().encode()
    write_durable(tmp_dir / MANIFEST_NAME, raw)
    fsync_tree(tmp_dir)
    write_durable(marker, marker_text(raw, key).encode())
    fsync_dir(tmp_dir)
    logger.debug(  # the checkpointer says it once per save: "checkpoint step N published"
        "committed %s (%d files, %d bytes)", tmp_dir, len(manifest.files), manifest.total_bytes
    )


def update_latest(layout: RunLayout, step: int) -> None:
    """Point latest.json at ``step``: a hint for the restorer, never the source of truth."""
    atomic_write_json(layout.latest_path, {"step": step, "dir": f"steps/{step_name(step)}"})


def fenced(fence: RunLease | None, what: str) -> contextlib.AbstractContextManager[None]:
    """``what`` under the lease (LeaseLostError if it was taken over); no lease: as is."""
    return fence.hold(what) if fence is not None else contextlib.nullcontext()


def set_aside(layout: RunLayout, step: int, reason: str, fence: RunLease | None = None) -> Path:
    """Move a published-looking but invalid dir out of the way, keeping it for forensics."""
    src = layout.step_dir(step)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    dst = layout.steps_dir / f".rejected-{src.name}-{stamp}"
    with fenced(fence, f"setting aside {src.name}"):
        src.rename(dst)
        fsync_dir(layout.steps_dir)
    logger.warning("moved invalid %s to %s: %s", src, dst.name, reason)
    return dst


def _check_can_publish(layout: RunLayout, tmp_dir: Path, step: int, replace_invalid: bool) -> None:
    parsed = parse_tmp(tmp_dir.name)
    in_steps_dir = tmp_dir.parent.resolve() == layout.steps_dir.resolve()
    if not in_steps_dir or parsed is None or parsed[0] != step:
        raise PublishError(f"{tmp_dir} is not a tmp dir for step {step} in {layout.steps_dir}")
    if not (tmp_dir / COMMITTED_NAME).is_file():
        raise PublishError(
            f"{tmp_dir} has no {COMMITTED_NAME}; call write_manifest_and_commit first"
        )
    final = layout.step_dir(step)
    if not final.exists():
        return
    verdict = verify_step_dir(final, read_manifest(tmp_dir).run_id, full=False)
    if verdict.ok or not replace_invalid:
        raise PublishError(
            f"{final} already exists ({verdict.reason}); published steps are "
            f"immutable and are never overwritten"
        )
    set_aside(layout, step, verdict.reason)


def publish(
    layout: RunLayout,
    tmp_dir: Path,
    step: int,
    replace_invalid: bool = False,
    fence: RunLease | None = None,
) -> Path:
    """Rename a committed tmp dir to its final name, then update latest.json.

    With ``replace_invalid`` an existing final dir that fails verification is moved aside
    (never deleted) so a new attempt that reached the same step again can still publish it.
    With ``fence`` the checks, the rename and latest.json happen under the lease mutex and only
    while the lease is still ours: a writer whose lease was taken over publishes nothing.
    """
    with fenced(fence, f"publishing step {step}"):
        _check_can_publish(layout, tmp_dir, step, replace_invalid)
        final = layout.step_dir(step)
        # rename(2) of a directory is atomic on POSIX filesystems: readers see the tmp name or
        # the final name, never a half-populated final dir. It fails if final is non-empty.
        tmp_dir.rename(final)
        fsync_dir(layout.steps_dir)
        update_latest(layout, step)
    logger.debug("published %s", final)  # the checkpointer's one line per save says it
    return final
