"""The storage side of the checkpoint publish protocol, with no torch import: layout, manifest,
checksums, verify, publish, select, retention, lease and attempt records. Pure files: callers
pass in what ranks gathered."""

from resiliency.storage.attempts import (
    AttemptConflictError,
    claim_attempt,
    ensure_run_record,
    next_attempt_id,
    write_attempt_record,
)
from resiliency.storage.checksum import FileEntry, describe_files, file_checksum, share_of
from resiliency.storage.layout import (
    RunLayout,
    atomic_write_json,
    fsync_dir,
    fsync_tree,
    parse_step,
    payload_files,
)
from resiliency.storage.lease import LeaseHeldError, LeaseInfo, LeaseLostError, RunLease, read_lease
from resiliency.storage.manifest import (
    Manifest,
    ManifestError,
    code_commit,
    image_digest,
    merge_file_entries,
    read_manifest,
    runtime_versions,
)
from resiliency.storage.publish import (
    PublishError,
    begin_step,
    publish,
    update_latest,
    write_manifest_and_commit,
)
from resiliency.storage.retention import GcPlan, apply_gc, plan_gc
from resiliency.storage.select import Selection, select_restore_step
from resiliency.storage.verify import Verdict, verify_step_dir

__all__ = [
    "AttemptConflictError",
    "FileEntry",
    "GcPlan",
    "LeaseHeldError",
    "LeaseInfo",
    "LeaseLostError",
    "Manifest",
    "ManifestError",
    "PublishError",
    "RunLayout",
    "RunLease",
    "Selection",
    "Verdict",
    "apply_gc",
    "atomic_write_json",
    "begin_step",
    "claim_attempt",
    "code_commit",
    "describe_files",
    "ensure_run_record",
    "file_checksum",
    "fsync_dir",
    "fsync_tree",
    "image_digest",
    "merge_file_entries",
    "next_attempt_id",
    "parse_step",
    "payload_files",
    "plan_gc",
    "publish",
    "read_lease",
    "read_manifest",
    "runtime_versions",
    "select_restore_step",
    "share_of",
    "update_latest",
    "verify_step_dir",
    "write_attempt_record",
    "write_manifest_and_commit",
]
