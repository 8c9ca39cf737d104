"""Submit a run to Slurm with sbatch: one launcher per node, emergency save on USR1, self-requeue.

`python -m launch slurm [--dry-run [--out DIR]] key=value ...` validates the overrides for the
launch layout (launch.nodes x launch.nproc_per_node), refuses a run directory a live job owns,
a job that would not make progress and a layout that does not fit its GPUs, then pins the
resolved config in <run_dir>/launch-config.yaml, renders <run_dir>/slurm/<run_id>.sbatch and
submits it (`sbatch --parsable`), printing the job id; when sbatch refuses the job, what was
written is undone. --dry-run runs the same checks and renders the same files into
DIR/<run_id> (default: a new temporary folder), never into the run dir, and prints the
script's path.
`python -m launch slurm status|logs|cancel NAME` follows a job (launch/slurm/manage.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import shutil
import subprocess
import sys
from pathlib import Path

from launch.common import (
    LaunchPlan,
    PendingWrites,
    Refusal,
    check_fit,
    check_progress,
    check_remote_tier,
    check_resume,
    check_run_dir_free,
    dry_run_dir,
    plan_launch,
    record_submission,
    refused_code,
    write_resolved_config,
)
from launch.elastic import check_launcher_release
from launch.slurm.manage import ACTIONS, manage
from launch.slurm.script import ScriptInputs, environment_warning, render_sbatch, runs_image_code
from pretrain.context.run_dir import RunDir
from recipes import ConfigError, RunConfig
from recipes.inputs import check_inputs
from resiliency.checkpoint.restore.init_source import is_remote
from resiliency.monitor.fault_tolerance import LAUNCHER_CONFIG_FILE, write_launcher_config
from resiliency.storage.manifest import code_commit, image_digest

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="check and render as a submission would, into --out DIR (default: a new "
        "temporary directory), never into the run dir; submit nothing",
    )
    parser.add_argument(
        "--out",
        type=Path,
        help="--dry-run: render into DIR/<run_id>/ (launch-config.yaml, slurm/<run_id>.sbatch) "
        "instead of a new temporary folder",
    )
    parser.add_argument(
        "--skip-fit-check",
        action="store_true",
        help="submit (or render) a GPU job even if `python -m pretrain --plan` says it does "
        "not fit",
    )
    parser.add_argument(
        "--skip-progress-check",
        action="store_true",
        help="submit even if the time limit fits fewer than two save intervals or the signal "
        "grace cannot cover a step and an emergency save",
    )
    parser.add_argument("--tail", type=int, help="logs: only the last N lines")
    parser.add_argument(
        "--skip-remote-check",
        action="store_true",
        help="checkpoint.remote: do not probe the object store from this host (the job's "
        "trainer still does, where it runs)",
    )


def _check_elastic(plan: LaunchPlan) -> None:
    """parallel.elastic's supervisor runs on the batch node with the job's python (the
    submitting venv's, or launch.slurm.python) and starts an ``srun`` step per node: inside a
    container step there is no srun."""
    run = plan.run
    if not run.parallel.elastic:
        return
    check_launcher_release()
    if run.launch.slurm.container_image:
        raise ConfigError(
            "parallel.elastic=true does not run with launch.slurm.container_image yet (the "
            "batch node's supervisor starts one srun step per node with the submitting venv); "
            "drop the image, or set parallel.elastic=false and use launch.slurm.min_nodes or "
            "launch.slurm.spare_nodes"
        )


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    if overrides and overrides[0] in ACTIONS:
        return manage(overrides[0], overrides[1:], args.tail)
    if args.out is not None and not args.dry_run:
        raise ConfigError("--out DIR is where --dry-run renders; a submission renders into the "
                          "run dir")  # fmt: skip
    try:
        plan, text = _checked(args, overrides)
    except Refusal as exc:
        return refused_code(exc)
    if args.dry_run:
        return _dry_run(plan, text, args.out)
    return _submit(plan, text, _find_sbatch())


def _checked(args: argparse.Namespace, overrides: list[str]) -> tuple[LaunchPlan, str]:
    """Every check that can refuse the job, the dry run's too, before anything is written:
    the plan and the rendered script."""
    # A dry run renders for a cluster whose file systems may not be mounted here: missing
    # inputs are reported, not fatal (a submission checks them).
    plan = _absolute_output_dir(plan_launch(overrides, not args.dry_run, time_limit=True))
    _check_elastic(plan)
    if args.dry_run:
        _warn_on_missing_inputs(plan)
        if args.out is not None:  # refused inside the run dir before the slow checks
            dry_run_dir(plan, args.out)
    check_run_dir_free(plan)
    slurm = plan.run.launch.slurm
    if not args.skip_progress_check:
        check_progress(
            plan, slurm.time_limit_s, slurm.signal_grace_s, "launch.slurm.signal_grace_s"
        )
    # What the ranks' restore would refuse: the run dir's newest step, or on its first launch
    # checkpoint.init_from's (a dry run's only where that path is mounted here).
    check_resume(plan, warm_start=not args.dry_run or _init_from_here(plan))
    _warn_on_short_grace(plan)
    text = render(plan)  # a value it cannot render is bad input too
    # After every check of the input: a bad value is reported as such, on any machine.
    if not args.dry_run and not args.skip_remote_check:  # before the fit check's model plan
        check_remote_tier(plan)
    if not args.skip_fit_check:  # the dry run too: it says what a submission would
        check_fit(plan)
    _warn_on_environment(plan)  # last: a refused job gets its one line only
    return plan, text


def _dry_run(plan: LaunchPlan, text: str, out: Path | None) -> int:
    """The files a submission would write, into a directory of the dry run's own; the script
    is the one a submission submits (its paths name the run dir)."""
    directory = dry_run_dir(plan, out)
    script = _write_run_files(plan, text, PendingWrites(), directory)
    log.info(
        "dry run: rendered %s and %s (not submitted; nothing written to %s)",
        script,
        RunDir(directory).launch_config_path,
        plan.run_dir,
    )
    print(script)
    return 0


def _submit(plan: LaunchPlan, text: str, sbatch: str) -> int:
    """Pin the config and the script, then submit. The config must be in place before sbatch
    returns (the job may start at once), so a job sbatch refuses has them undone."""
    writes = PendingWrites()
    try:
        script = _write_run_files(plan, text, writes, plan.run_dir)
        job_id = submit(sbatch, script)
    except (ConfigError, OSError):  # sbatch refused it, or the run dir took no file: no job
        writes.undo()
        raise
    record_submission(plan, "slurm", {"job_id": job_id, "script": str(script)})
    log.info(
        "submitted job %s for run %s (output: %s/slurm/)", job_id, plan.run.run_id, plan.run_dir
    )
    print(job_id)
    return 0


def _write_run_files(plan: LaunchPlan, text: str, writes: PendingWrites, directory: Path) -> Path:
    """The pinned config, ft_launcher's config and the batch script, under ``directory``;
    the script's path."""
    write_resolved_config(plan, writes, directory)
    if plan.run.launch.backend == "ft_launcher":
        write_launcher_config(plan.run, writes.prepare(directory / LAUNCHER_CONFIG_FILE).parent)
    script = directory / "slurm" / f"{plan.run.run_id}.sbatch"
    return writes.write_text(script, text, mode=0o755)


def _absolute_output_dir(plan: LaunchPlan) -> LaunchPlan:
    # Pinned absolute, so every node and restart finds the same run dir whatever its working
    # directory (the script may be resubmitted from elsewhere).
    output_dir = Path(plan.run.output_dir).absolute()
    run = dataclasses.replace(plan.run, output_dir=str(output_dir))
    if runs_image_code(run):  # the job starts in its run dir, not here: pin the inputs too
        run = _absolute_inputs(run)
    return dataclasses.replace(plan, run=run, run_dir=output_dir / run.run_id)


def _absolute_inputs(run: RunConfig) -> RunConfig:
    def absolute(path: str | None) -> str | None:
        return str(Path(path).absolute()) if path else path

    data = dataclasses.replace(
        run.data,
        paths=[absolute(p) for p in run.data.paths],
        tokenizer_path=absolute(run.data.tokenizer_path),
        cache_dir=absolute(run.data.cache_dir),
    )
    local = dataclasses.replace(run.checkpoint.local, dir=absolute(run.checkpoint.local.dir))
    checkpoint = dataclasses.replace(run.checkpoint, local=local)
    return dataclasses.replace(run, data=data, checkpoint=checkpoint)


def _find_sbatch() -> str:
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise ConfigError(
            "sbatch not found on PATH: submit from a Slurm login node (or source "
            "the cluster's environment), or pass --dry-run to only render the "
            "batch script"
        )
    return sbatch


def _warn_on_missing_inputs(plan: LaunchPlan) -> None:
    try:
        check_inputs(plan.run)
    except ConfigError as exc:
        log.warning("dry run, rendered anyway: %s", exc)
    source = plan.run.checkpoint.init_from
    if source is not None and not is_remote(source) and not _init_from_here(plan):
        log.warning("dry run, rendered anyway: checkpoint.init_from=%s does not exist here", source)


def _init_from_here(plan: LaunchPlan) -> bool:
    source = plan.run.checkpoint.init_from
    return source is not None and Path(source).expanduser().exists()


def _warn_on_environment(plan: LaunchPlan) -> None:
    """A GPU job that names no environment of the cluster's runs the submitting one there."""
    warning = environment_warning(plan.run, Path(sys.executable).parent)
    if warning:
        log.warning("%s", warning)


def _warn_on_short_grace(plan: LaunchPlan) -> None:
    grace = plan.run.launch.slurm.signal_grace_s
    save = plan.run.resiliency.emergency_save_timeout_s
    if plan.run.resiliency.preemption and grace < save:
        log.warning(
            "launch.slurm.signal_grace_s=%d is shorter than "
            "resiliency.emergency_save_timeout_s=%.0f: at the time limit Slurm may kill "
            "the job before its emergency save ends",
            grace,
            save,
        )


def render(plan: LaunchPlan) -> str:
    inputs = ScriptInputs(
        config_path=RunDir(plan.run_dir).launch_config_path,
        run_dir=plan.run_dir,
        workdir=Path.cwd(),
        bin_dir=Path(sys.executable).parent,  # launch.slurm.python replaces it
        code_commit=code_commit(),
        image_digest=image_digest(),
    )
    return render_sbatch(plan.run, inputs)


def submit(sbatch: str, script: Path) -> str:
    """Submit ``script``; the job id, or ConfigError with sbatch's own message."""
    proc = subprocess.run(
        [sbatch, "--parsable", str(script)], capture_output=True, text=True, timeout=120
    )
    if proc.returncode != 0:
        raise ConfigError(
            f"sbatch refused {script} (exit {proc.returncode}): "
            f"{proc.stderr.strip() or proc.stdout.strip()}"
        )
    # --parsable prints "<job id>[;<cluster>]"
    return proc.stdout.strip().split(";")[0]
