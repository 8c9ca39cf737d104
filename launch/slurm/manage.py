"""``python -m launch slurm status|logs|cancel NAME``: the Kubernetes adapter's status, logs and
delete, for Slurm jobs.

NAME is a job id, a run dir (its ``submission-slurm.json`` names the job), or a job name (our
jobs are named after their run id, so ``squeue --name`` finds them). Status comes from
``scontrol show job`` while Slurm remembers the job (MinJobAge after it ends), else from
``sacct`` where accounting runs, and always the run dir's own record: its newest committed
step and the newest attempt's status. Logs are the run dir's ``slurm/*.out`` files (every
requeue appends to the job's one file).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from launch.common import submission_path
from pretrain.context import exit_codes
from recipes import ConfigError
from resiliency.storage.layout import RunLayout

ACTIONS = ("status", "logs", "cancel")
_FIELDS = ("JobId", "JobName", "JobState", "Reason", "RunTime", "TimeLimit", "Restarts",
           "NodeList", "ExitCode", "StdOut")  # fmt: skip


class SlurmToolMissing(ConfigError):
    """A Slurm client tool is not on PATH: not a login node."""


@dataclass(frozen=True)
class SlurmJob:
    job_id: str
    run_dir: Path | None  # None: Slurm does not say and no run dir was given


def manage(action: str, words: list[str], tail: int | None) -> int:
    if len(words) != 1:
        raise ConfigError(
            f"usage: python -m launch slurm {action} NAME (a job id, a run dir or a run id); "
            f"got {words}"
        )
    job = find_job(words[0])
    if action == "status":
        print(status(job))
    elif action == "logs":
        print(logs(job, tail), end="")
    else:
        _slurm("scancel", job.job_id)
        print(f"cancelled job {job.job_id}")
    return exit_codes.OK


def find_job(name: str) -> SlurmJob:
    """The job ``name`` means; ConfigError (one line, what was tried) when there is none."""
    if name.isdigit():
        return SlurmJob(name, _run_dir_of(name))
    path = Path(name)
    if (record := submission_path(path, "slurm")).is_file():
        return SlurmJob(str(json.loads(record.read_text())["job_id"]), path)
    found = _slurm("squeue", "--noheader", "--name", name, "--format=%i").split()
    if len(found) == 1:
        return SlurmJob(found[0], _run_dir_of(found[0]))
    if len(found) > 1:
        raise ConfigError(f"{len(found)} Slurm jobs are named {name!r} ({', '.join(found)}): "
                          "give the job id")  # fmt: skip
    raise ConfigError(
        f"no Slurm job {name!r}: not a job id, not a run dir with a "
        f"{submission_path(Path(), 'slurm')}, and squeue lists no job of that name (a "
        "finished job: give its run dir)"
    )


def _run_dir_of(job_id: str) -> Path | None:
    """Our jobs write ``<run_dir>/slurm/<name>-<id>.out``: the run dir is two levels up."""
    out = _show(job_id).get("StdOut")
    return Path(out).parent.parent if out and Path(out).parent.name == "slurm" else None


def status(job: SlurmJob) -> str:
    shown = _show(job.job_id)
    if shown:
        lines = [" ".join(f"{k}={shown[k]}" for k in _FIELDS if k in shown)]
    else:
        lines = [_accounting(job.job_id)]
    if job.run_dir is not None and job.run_dir.is_dir():
        # resiliency.cli loads every command (0.3 s): only for status, not for `launch --help`
        from resiliency.cli.run_table import run_rows

        layout = RunLayout(job.run_dir.parent, job.run_dir.name)
        lines += [f"run dir {job.run_dir}:", *run_rows([layout])]
    return "\n".join(lines)


def logs(job: SlurmJob, tail: int | None) -> str:
    if job.run_dir is None:
        raise ConfigError(f"job {job.job_id}: Slurm no longer says where its run dir is; give "
                          "the run dir as NAME")  # fmt: skip
    outs = sorted((job.run_dir / "slurm").glob(f"*-{job.job_id}.out"))
    if not outs:
        raise ConfigError(f"job {job.job_id} has no output in {job.run_dir}/slurm yet")
    text = "".join(p.read_text(errors="replace") for p in outs)
    if tail is not None:
        text = "".join(text.splitlines(keepends=True)[-tail:])
    return text


def _show(job_id: str) -> dict[str, str]:
    """``scontrol show job -o``'s fields, empty once Slurm has forgotten the job."""
    try:
        out = _slurm("scontrol", "show", "job", "-o", job_id)
    except SlurmToolMissing:
        raise
    except ConfigError:  # "Invalid job id specified": forgotten (or never was)
        return {}
    return dict(re.findall(r"(\w+)=(\S*)", out))


def _accounting(job_id: str) -> str:
    try:
        out = _slurm("sacct", "-n", "-P", "-X", "-j", job_id,
                     "--format=JobID,JobName,State,Elapsed,ExitCode,NodeList")  # fmt: skip
    except ConfigError as exc:  # no accounting storage, or no sacct
        return f"job {job_id}: Slurm no longer shows it and sacct cannot say ({exc})"
    fields = ("JobId", "JobName", "JobState", "Elapsed", "ExitCode", "NodeList")
    rows = [dict(zip(fields, line.split("|"))) for line in out.splitlines() if line]
    if not rows:
        return f"job {job_id}: unknown to scontrol and sacct"
    return " ".join(f"{k}={v}" for k, v in rows[-1].items())


def _slurm(tool: str, *args: str) -> str:
    """Run a Slurm client tool; ConfigError with its own message when it fails."""
    path = shutil.which(tool)
    if path is None:
        raise SlurmToolMissing(f"{tool} not found on PATH: run this on a Slurm login node")
    proc = subprocess.run([path, *args], capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        raise ConfigError(f"{tool} {' '.join(args)}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout
