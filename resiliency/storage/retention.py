"""Garbage collection of old steps and dead attempts' tmp dirs.

Plan first (pure, printable), apply second. A step dir is renamed to a .trash- name before it is
removed, so a crash mid-delete leaves a name the restorer never considers, not a half step dir
that still looks published.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from resiliency.storage.attempts import TERMINAL_STATUSES, read_attempt_record
from resiliency.storage.layout import TRASH_PREFIX, RunLayout, fsync_dir
from resiliency.storage.lease import RunLease, owner_liveness
from resiliency.storage.verify import verify_step_dir

logger = logging.getLogger(__name__)

MIN_KEEP_LAST = 2


@dataclass
class GcPlan:
    delete_steps: list[tuple[Path, str]] = field(default_factory=list)
    delete_tmp: list[tuple[Path, str]] = field(default_factory=list)
    delete_trash: list[tuple[Path, str]] = field(default_factory=list)
    keep: list[tuple[Path, str]] = field(default_factory=list)

    @property
    def deletions(self) -> list[tuple[Path, str]]:
        return self.delete_steps + self.delete_tmp + self.delete_trash


def plan_gc(
    layout: RunLayout,
    run_id: str,
    keep_last: int,
    milestone_interval: int | None,
    protected: set[int],
    live_attempt: int | None,
) -> GcPlan:
    if keep_last < MIN_KEEP_LAST:
        raise ValueError(
            f"keep_last must be >= {MIN_KEEP_LAST} (the newest and the previous "
            f"verified step), got {keep_last}"
        )
    if milestone_interval is not None and milestone_interval <= 0:
        raise ValueError(f"milestone_interval must be positive, got {milestone_interval}")
    plan = GcPlan()
    verdicts = {
        s: verify_step_dir(layout.step_dir(s), run_id, full=False) for s in layout.published_steps()
    }
    verified = sorted(s for s, v in verdicts.items() if v.ok)
    if not verified:
        # Without a restorable step any dir may be the only material left to recover from.
        dirs = [layout.step_dir(s) for s in verdicts] + [t[0] for t in layout.tmp_dirs()]
        plan.keep = [(d, "no verified step exists: nothing is deleted") for d in dirs]
        return plan
    recent = set(verified[-keep_last:])
    for step, verdict in verdicts.items():
        reason_keep = _keep_reason(
            step, verdict.ok, recent, verified[-1], milestone_interval, protected
        )
        target = plan.keep if reason_keep else plan.delete_steps
        why = reason_keep or (
            f"older than the last {keep_last} verified steps"
            if verdict.ok
            else f"invalid and older than newest verified: {verdict.reason}"
        )
        target.append((layout.step_dir(step), why))
    _plan_tmp(layout, live_attempt, plan)
    plan.delete_trash = [(p, "leftover of an interrupted delete") for p in layout.trash_dirs()]
    return plan


def _keep_reason(
    step: int,
    ok: bool,
    recent: set[int],
    newest: int,
    milestone_interval: int | None,
    protected: set[int],
) -> str | None:
    if step in protected:
        return "protected (e.g. restored from, until a newer step is committed)"
    if step > newest:
        return "newer than the newest verified step (kept for inspection)"
    if not ok:
        return None
    if step in recent:
        return "among the last verified steps"
    if milestone_interval and step % milestone_interval == 0:
        return f"milestone (every {milestone_interval} steps)"
    return None


def _plan_tmp(layout: RunLayout, live_attempt: int | None, plan: GcPlan) -> None:
    live = read_attempt_record(layout, live_attempt) if live_attempt is not None else None
    generation = (live or {}).get("lease_generation")
    for path, _step, attempt in layout.tmp_dirs():
        if attempt == live_attempt:
            plan.keep.append((path, f"tmp dir of live attempt {attempt}"))
            continue
        over = _attempt_over(read_attempt_record(layout, attempt), generation)
        if over is None:
            plan.keep.append((path, f"tmp dir of attempt {attempt}, which may still be writing "
                                    "(its lease was taken over, it is not known to be dead): "
                                    "left for a later pass"))  # fmt: skip
        else:
            plan.delete_tmp.append((path, f"tmp dir of attempt {attempt} ({over})"))


def _attempt_over(record: dict | None, live_generation: int | None) -> str | None:
    """Why an earlier attempt can no longer be writing its tmp dirs, or None when it might:
    a fenced owner woken from a stall may still be writing (never delete under it)."""
    if record is None or record.get("lease_generation") is None or live_generation is None:
        return "dead attempt"  # recorded before fencing: the old rule
    if record.get("status") in TERMINAL_STATUSES:
        return f"ended: {record['status']}"
    alive, why = owner_liveness(
        record.get("host"), record.get("pid"), record.get("pid_ns"), record.get("pid_start")
    )
    if alive is False:
        return why
    if int(record["lease_generation"]) <= int(live_generation) - 2:
        return f"its lease generation {record['lease_generation']} was superseded twice"
    return None


def _remove(path: Path, fence: RunLease | None) -> None:
    trash = (
        path
        if path.name.startswith(TRASH_PREFIX)
        else (path.with_name(f"{TRASH_PREFIX}{path.name}-{uuid.uuid4().hex[:8]}"))
    )
    if trash != path:
        # The rename is what a restore sees: fenced. Emptying the trash is not.
        with fence.hold(f"retention delete of {path.name}") if fence else contextlib.nullcontext():
            path.rename(trash)
            fsync_dir(path.parent)
    shutil.rmtree(trash)


def apply_gc(plan: GcPlan, fence: RunLease | None = None) -> list[Path]:
    """Delete what ``plan`` lists; returns what was deleted. Vanished paths are skipped. With
    ``fence``, each step leaves only while the lease is still ours (else LeaseLostError)."""
    deleted = []
    for path, reason in plan.deletions:
        try:
            _remove(path, fence)
        except FileNotFoundError:
            logger.info("gc: %s already gone", path)
            continue
        logger.debug("gc: deleted %s (%s)", path, reason)  # `resiliency gc` prints its count
        deleted.append(path)
    return deleted
