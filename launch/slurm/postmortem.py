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
from resiliency.storage.attempts import recorded_attempts
from resiliency.storage.layout import RunLayout

log = logging.getLogger(__name__)
_SRUN_LABEL = re.compile(r"^\s*\d+: ")


def launcher_events(job_log: Path) -> LauncherEvents:
    """The launchers' events in ``job_log`` (unstamped lines take the log's last write)."""
    events = LauncherEvents()
    written = job_log.stat().st_mtime
    for line in job_log.read_text(errors="replace").splitlines():
        events.feed(_SRUN_LABEL.sub("", line, count=1), written)
    return events


def finalize_job(run_dir: Path, after_attempt: int, job_log: Path, tokens_per_step: int) -> None:
    """Finalize this job's attempts (those above ``after_attempt``); a log or record that
    cannot be read leaves the records as the ranks wrote them."""
    layout = RunLayout.from_run_dir(run_dir)
    attempts = [a for a in recorded_attempts(layout) if a > after_attempt]
    if not attempts:
        return
    try:
        finalize_attempts(layout, attempts, launcher_events(job_log), tokens_per_step)
    except (OSError, ValueError) as exc:
        log.warning("post-mortem of attempts %s skipped: %s", attempts, exc)
