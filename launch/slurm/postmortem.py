"""The post-mortem of a Slurm job's attempts, as ``launch local`` runs it after each launch:
root cause, work lost and the recovery ledger merged into the attempt records of this job.

The launchers' lines come from the job's restart log (``srun --label`` prefixes each with its
task number); ft_launcher and torchrun stamp their own lines, so the moments are theirs, not
the time this reader runs.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from resiliency.monitor.postmortem import LauncherEvents, finalize_attempts
from resiliency.storage.layout import RunLayout

log = logging.getLogger(__name__)
_SRUN_LABEL = re.compile(r"^\s*\d+: ")


def launcher_events(job_log: Path) -> LauncherEvents:
    """The launchers' events in ``job_log`` (unstamped lines take the log's last write).

    With several nodes their per-worker exit lines are dropped: every node's launcher numbers
    its workers from local rank 0 and logs its own child's pid (with spares or standby workers,
    the entrypoint's, not the trainer's), so they name no rank; who died first and how comes
    from the worker's parent's record (:mod:`pretrain.context.worker_exits`) and the ranks'
    failure files."""
    events, tasks = LauncherEvents(), set()
    written = job_log.stat().st_mtime
    for line in job_log.read_text(errors="replace").splitlines():
        if label := _SRUN_LABEL.match(line):
            tasks.add(label.group(0).strip())
        events.feed(_SRUN_LABEL.sub("", line, count=1), written)
    if len(tasks) > 1:
        events.exits.clear()
    return events


def finalize_job(
    layout: RunLayout, attempts: list[int], events: LauncherEvents, tokens_per_step: int
) -> None:
    """Finalize this job's ``attempts`` from its launchers' ``events``; a record that cannot be
    read leaves the records as the ranks wrote them."""
    if not attempts:
        return
    try:
        finalize_attempts(layout, attempts, events, tokens_per_step)
    except Exception as exc:  # noqa: BLE001 - the retry decision must still be made
        log.warning("post-mortem of attempts %s skipped: %r", attempts, exc)
