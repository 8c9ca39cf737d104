"""What every adapter does before it renders or submits: validate, pin the config, check the run.

Every check that can refuse a launch runs before anything is written, so a refused launch leaves
the run dir byte-identical; a dry run renders into a directory of its own (``dry_run_dir``),
never into the run dir, whose pinned config a queued or running job of the run trains from.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pretrain.context import exit_codes
from pretrain.context.failures import ClassifiedError
from pretrain.context.run_dir import RunDir
from pretrain.fit.timing import progress_problems, resolve_save_interval
from recipes import ConfigError, RunConfig, load_config, to_yaml
from recipes.inputs import check_inputs
from recipes.validate import new_launch_id, resolve_run_id, validate_runtime
from resiliency.checkpoint.restore.init_source import judge_warm_start
from resiliency.checkpoint.restore.preflight import judge_resume
from resiliency.checkpoint.restore.resume_policy import PolicyRefusal
from resiliency.checkpoint.restore.topology import TopologyRefusedError
from resiliency.storage.layout import RunLayout, atomic_write_json
from resiliency.storage.lease import owner_liveness, read_lease

log = logging.getLogger(__name__)
GIB = 1 << 30


@dataclass(frozen=True)
class LaunchPlan:
    run: RunConfig
    overrides: list[str]
    run_dir: Path
    device: str
    dp: int


def plan_launch(
    overrides: Sequence[str], check_files: bool = True, time_limit: bool = False
) -> LaunchPlan:
    """Compose and validate for the launch layout (nodes x ranks per node), before submitting.
    ``check_files``: the data, tokenizer and output dir are paths this machine sees (not so
    for a pod's volumes). ``time_limit``: the job ends at launch.slurm.time_limit, which
    bounds checkpoint.save_interval=auto."""
    # A launch that names no run starts one; the pinned config keeps the name for every rank,
    # restart and requeue of this launch.
    run = resolve_run_id(load_config(list(overrides)), new_launch_id(), world_size=1)
    # "auto" becomes a number here and is pinned: every requeue saves at the same steps.
    run = resolve_save_interval(run, run.launch.slurm.time_limit_s if time_limit else None)
    device = "cuda" if run.launch.gpus_per_node > 0 else "cpu"
    try:
        dp = validate_runtime(run, run.launch.world_size, device)
    except ConfigError as exc:
        raise ConfigError(
            f"{exc} (launch.nodes={run.launch.nodes} x "
            f"launch.nproc_per_node={run.launch.nproc_per_node} = "
            f"{run.launch.world_size} ranks)"
        ) from None
    _check_shrunk_layout(run, device)
    if check_files:
        check_inputs(run)
    return LaunchPlan(run, list(overrides), Path(run.output_dir) / run.run_id, device, dp)


def refuse_elastic(plan: LaunchPlan, launcher: str) -> None:
    """parallel.elastic resizes inside one job under ``launch local`` and ``launch slurm``
    only so far: any other launcher would silently run a fixed-size job, so it is refused with
    the ways it does resize."""
    if not plan.run.parallel.elastic:
        return
    raise ConfigError(
        f"parallel.elastic=true: launch {launcher} does not resize inside a job yet (launch "
        "local and launch slurm do); set parallel.elastic=false, or launch with slurm"
    )


def shrink_sizes(run: RunConfig) -> tuple[str, list[int]]:
    """The node counts below launch.nodes the job may train at, and the key that allows them
    (parallel.elastic's launch.min_nodes, or launch.slurm.min_nodes at a requeue)."""
    if run.parallel.elastic:
        key, low = "launch.min_nodes", run.launch.min_nodes
    else:
        key, low = "launch.slurm.min_nodes", run.launch.slurm.min_nodes
    return key, list(range(low or run.launch.nodes, run.launch.nodes))


def _check_shrunk_layout(run: RunConfig, device: str) -> None:
    """A job allowed to shrink must train at every size down to its minimum: refused now, not
    at a requeue or a lost node hours later."""
    key, sizes = shrink_sizes(run)
    for nodes in sizes:
        try:
            validate_runtime(run, nodes * run.launch.nproc_per_node, device)
        except ConfigError as exc:
            low = sizes[0]
            raise ConfigError(
                f"{key}={low}: at {nodes} node(s) x {run.launch.nproc_per_node} ranks: {exc}"
            ) from None


def worker_module(run: RunConfig) -> str:
    """The module the launcher starts per rank: the trainer, or the worker entrypoint that
    forks it from the standby and, with spare nodes or elastic, tells the launcher how it
    ended (launch.spares)."""
    wrapped = run.launch.standby or run.launch.slurm.spare_nodes > 0 or run.parallel.elastic
    return "launch.standby.worker" if wrapped else "pretrain"


def rank_env(run: RunConfig) -> dict[str, str]:
    """Environment megatron-core expects on every rank for this layout.

    With tensor or context parallelism (sequence parallelism implies TP) megatron-core overlaps
    its TP/CP communication with compute only if the GPU runs one hardware queue:
    CUDA_DEVICE_MAX_CONNECTIONS=1, as Megatron-LM asserts and Megatron-Bridge sets.
    """
    par = run.parallel
    if par.tp > 1 or par.cp > 1 or par.sequence_parallel:
        return {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    return {}


class Refusal(ConfigError):
    """A launch refused with an exit code of its own, the one the trainer would have exited
    with (each launcher's ``run`` maps it: ``refused_code``)."""

    exit_code = exit_codes.CONFIG_ERROR


class RunDirOwned(Refusal):
    """The run dir's lease is held by a live job: exit LEASE_HELD (6), as the trainer's own
    acquire would, not CONFIG_ERROR."""

    exit_code = exit_codes.LEASE_HELD


class ResumeRefused(Refusal):
    """The newest published step cannot be resumed with this launch's config (2) or layout
    (TOPOLOGY_REFUSED, 3): said before any rank starts."""


def refused_code(exc: Refusal) -> int:
    """Say a refusal that has an exit code of its own in one line; its code."""
    log.error("%s", exc)
    return exc.exit_code


def check_resume(plan: LaunchPlan, warm_start: bool = True) -> None:
    """The resume rules the ranks' restore applies (tokenizer, topology, the resume policy),
    judged on the newest published step's manifest (or, on a run's first launch, on
    checkpoint.init_from's step) before any rank starts: one line and the
    trainer's own exit code. A multi-line verdict (the topology table, every changed key) goes
    to a file outside the run dir, which the line names. ``warm_start``: judge
    checkpoint.init_from too (its path as this host sees it)."""
    world_size = plan.run.launch.world_size
    try:
        if judge_resume(plan.run, plan.run_dir, world_size, plan.dp) is None and warm_start:
            judge_warm_start(plan.run, plan.run_dir, world_size, plan.dp)
    except TopologyRefusedError as exc:
        raise _one_line(plan, str(exc), exit_codes.TOPOLOGY_REFUSED) from None
    except PolicyRefusal as exc:  # the changed keys inline, "key: saved -> now"
        keys = [change.describe() for change in exc.changes]
        raise _one_line(plan, str(exc), exit_codes.CONFIG_ERROR, keys) from None
    except ConfigError as exc:
        raise _one_line(plan, str(exc), exit_codes.CONFIG_ERROR) from None
    except ClassifiedError as exc:  # checkpoint.init_from's steps do not verify: exit 10
        raise _one_line(plan, str(exc), exc.exit_code) from None


def _one_line(
    plan: LaunchPlan, verdict: str, code: int, keys: list[str] | None = None
) -> ResumeRefused:
    first, _, rest = verdict.partition("\n")
    line = first.rstrip(":")
    if keys:  # a table (the topology's) is not inline: it is in the file
        line += ": " + "; ".join(keys[:3]) + ("; ..." if len(keys) > 3 else "")
    if rest.strip():
        fd, path = tempfile.mkstemp(prefix=f"mcore-recipes-refused-{plan.run.run_id}-",
                                    suffix=".txt")  # fmt: skip
        with os.fdopen(fd, "w") as out:
            out.write(verdict + "\n")
        line += f" (in full, with what to do: {path})"
    refusal = ResumeRefused(line)
    refusal.exit_code = code
    return refusal


def check_run_dir_free(plan: LaunchPlan) -> None:
    """Refuse to submit a second job onto a run whose lease a job provably alive holds (on
    this host); any other owner is judged by the trainer's own acquire, which watches it."""
    layout = RunLayout(plan.run_dir.parent, plan.run.run_id)
    try:
        info = read_lease(layout)
    except ValueError:
        return  # unreadable lease: the trainer's own acquire decides
    if info is not None and owner_liveness(info.host, info.pid, info.pid_ns, info.pid_start)[0]:
        raise RunDirOwned(
            f"run dir {plan.run_dir} is owned by a live job "
            f"({info.describe()}); stop it or choose another run_id"
        )


class PendingWrites:
    """Files a launch writes before its scheduler accepts it, undone when the scheduler refuses
    it (sbatch exits non-zero): the run dir is then byte-identical (names, bytes, modes) to
    what it was, and no requeue of an earlier job of the run trains from a config nobody
    submitted."""

    def __init__(self) -> None:
        self._saved: dict[Path, tuple[bytes, int] | None] = {}  # None: the file was absent
        self._made: list[Path] = []  # directories created, outermost first

    def prepare(self, path: Path) -> Path:
        """Remember what ``path`` holds (once) and create its missing parent directories;
        for a file someone else writes (write_launcher_config)."""
        if path not in self._saved:
            self._saved[path] = _snapshot(path)
        missing = [d for d in (path.parent, *path.parent.parents) if not d.exists()]
        for directory in reversed(missing):
            try:
                directory.mkdir()
            except FileExistsError:
                continue  # made meanwhile by someone else: theirs to keep
            self._made.append(directory)
        return path

    def write_text(self, path: Path, text: str, mode: int | None = None) -> Path:
        """``path`` replaced atomically by ``text`` (a reader sees the old or the new file)."""
        self.prepare(path)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        if mode is not None:
            tmp.chmod(mode)
        tmp.replace(path)
        return path

    def undo(self) -> None:
        """Every file back as it was, every directory made removed (newest first)."""
        for path, saved in reversed(self._saved.items()):
            _restore(path, saved)
        for directory in reversed(self._made):
            try:
                directory.rmdir()
            except OSError as exc:  # not empty: someone else wrote there meanwhile
                log.warning("launch: left %s in place (%s)", directory, exc.strerror or exc)


def _snapshot(path: Path) -> tuple[bytes, int] | None:
    try:
        return path.read_bytes(), stat.S_IMODE(path.stat().st_mode)
    except FileNotFoundError:
        return None


def _restore(path: Path, saved: tuple[bytes, int] | None) -> None:
    if saved is None:
        path.unlink(missing_ok=True)
        return
    data, mode = saved
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    tmp.chmod(mode)
    tmp.replace(path)


def write_resolved_config(
    plan: LaunchPlan, writes: PendingWrites | None = None, directory: Path | None = None
) -> Path:
    """Pin the resolved config in the run dir (every rank and requeue loads this file), once
    every check passed; or in ``directory``, a dry run's."""
    path = RunDir(directory or plan.run_dir).launch_config_path
    return (writes or PendingWrites()).write_text(path, to_yaml(plan.run))


def dry_run_dir(plan: LaunchPlan, out: Path | None) -> Path:
    """Where a dry run renders: ``out/<run_id>`` (``out`` is to a dry run what output_dir is
    to a run, so a sweep's points do not collide), else a new temporary directory. Never the
    run dir: a queued or running job of the run requeues from the config pinned there."""
    if out is not None:
        return outside_run_dir(plan, out / plan.run.run_id)
    safe = plan.run.run_id.replace(os.sep, "_")
    return Path(tempfile.mkdtemp(prefix=f"mcore-recipes-dry-run-{safe}-"))


def outside_run_dir(plan: LaunchPlan, out: Path) -> Path:
    """``out`` made absolute; ConfigError when it is the run dir or inside it (``--out`` of a
    dry run, which writes nothing into the run dir)."""
    out, run_dir = out.absolute(), plan.run_dir.absolute()
    if out == run_dir or run_dir in out.parents:
        raise ConfigError(
            f"--out: a dry run never writes into the run dir {run_dir}, and {out} is in it; "
            "choose a folder outside it (or leave --out out: a new temporary folder)"
        )
    return out


def submission_path(run_dir: Path, backend: str) -> Path:
    """Where a launcher records what it submitted (the job id, the manifest)."""
    return run_dir / f"submission-{backend}.json"


def record_submission(plan: LaunchPlan, backend: str, detail: dict) -> None:
    atomic_write_json(
        submission_path(plan.run_dir, backend),
        {"backend": backend, "time": time.time(), "overrides": plan.overrides, **detail},
    )


def check_remote_tier(plan: LaunchPlan) -> None:
    """checkpoint.remote, before any rank starts: the bucket answers these credentials and the
    server honours conditional writes (resiliency/storage/remote_preflight.py); ConfigError
    (exit 2) with one line if not. The trainer checks again where it runs."""
    if not plan.run.checkpoint.remote.enabled:
        return
    # boto3 (0.2 s): only for runs with an object-store tier, not for every --help
    from resiliency.storage.remote_preflight import RemotePreflightError, check_remote

    try:
        result = check_remote(plan.run.checkpoint.remote, plan.run_dir.name)
    except RemotePreflightError as exc:
        raise ConfigError(str(exc)) from None
    if result is not None:
        honoured = "honoured" if result.conditional else "IGNORED (allowed)"
        log.info("launch: object store %s reachable, conditional writes %s (%.1f s)",
                 result.url, honoured, result.seconds)  # fmt: skip


def check_progress(
    plan: LaunchPlan, time_limit_s: float | None, grace_s: float, grace_key: str
) -> None:
    """A job that would not make progress is refused before it is submitted: one that ends
    before two save intervals, or whose grace cannot cover a step and an emergency save
    (pretrain/fit/timing.py). Arithmetic on the config: it runs with --dry-run too."""
    problems = progress_problems(plan.run, time_limit_s, grace_s, grace_key)
    if problems:
        raise ConfigError(
            "this job would not make progress: "
            + "; and ".join(problems)
            + " (submit anyway with --skip-progress-check)"
        )


def check_fit(plan: LaunchPlan) -> None:
    """Before a GPU job is submitted: ``python -m pretrain --plan`` for its layout on
    ``launch.gpu``; ConfigError when the busiest rank does not fit. A plan that cannot be made
    here (the tokenizer's files are elsewhere) is reported and skipped, not fatal."""
    if plan.device != "cuda":
        return
    _check_fit_at(plan, [])
    key, sizes = shrink_sizes(plan.run)
    if sizes and plan.run.parallel.elastic:
        # The fewest nodes hold the largest distributed-optimizer shard per GPU.
        smallest = [f"launch.nodes={sizes[0]}", "launch.min_nodes=null", "parallel.elastic=false"]
        try:
            _check_fit_at(plan, smallest)
        except ConfigError as exc:
            raise ConfigError(f"{key}={sizes[0]}: at {sizes[0]} node(s): {exc}") from None


def _check_fit_at(plan: LaunchPlan, resize: list[str]) -> None:
    result = _plan_result(plan, resize)
    if result is None:
        return
    peak = max(result["memory"], key=lambda m: m["total"])
    log.info(
        "fit check: stage %d needs %.1f GiB of %.1f GiB usable on %s",
        peak["pp_rank"],
        peak["total"] / GIB,
        result["usable_bytes"] / GIB,
        result["gpu"],
    )
    if result["fits"]:
        return
    fix = result["fix"] or "none of recompute, a smaller micro-batch, 2x TP or 2x PP alone"
    raise ConfigError(
        f"the layout does not fit {result['gpu']}: pipeline stage {peak['pp_rank']} needs "
        f"{peak['total'] / GIB:.1f} GiB of {result['usable_bytes'] / GIB:.1f} GiB usable; the "
        f"smallest change that fits: {fix} (details: python -m pretrain "
        f"{' '.join([*plan.overrides, *resize])} --plan; submit anyway with --skip-fit-check)"
    )


def _plan_result(plan: LaunchPlan, resize: list[str]) -> dict | None:
    """``python -m pretrain --plan --json`` for the launch's overrides; None, with a warning,
    where the plan cannot be made here (exit 2: the tokenizer's files are elsewhere; or it
    crashed: exit 1 without its JSON line)."""
    # A process of its own: the plan initialises a fake process group and megatron-core.
    cmd = [sys.executable, "-m", "pretrain", *plan.overrides, *resize, "--plan", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    last = (proc.stdout.strip().splitlines() or [""])[-1]
    if proc.returncode in (0, 1) and last.startswith("{"):
        try:
            return json.loads(last)
        except json.JSONDecodeError:
            pass
    reason = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    log.warning("fit check skipped (the plan failed, exit %d: %s)", proc.returncode, reason)
    return None


def uploader_args(run: RunConfig, run_dir: Path | str, follow: bool) -> list[str] | None:
    """``-m resiliency upload ...`` for the run's object-store tier (None when it is off): the
    launchers run it beside the job (``follow``), then once more after it for the last step."""
    remote = run.checkpoint.remote
    if remote.url is None:
        return None
    args = ["-m", "resiliency", "upload", str(run_dir), "--to", remote.url,
            f"--workers={remote.workers}", f"--keep-last={remote.keep_last}"]  # fmt: skip
    if remote.endpoint_url:
        args.append(f"--endpoint-url={remote.endpoint_url}")
    if run.checkpoint.milestone_interval:
        args.append(f"--milestone-interval={run.checkpoint.milestone_interval}")
    if follow:
        args += ["--follow", f"--interval={remote.follow_interval_s:g}"]
    return args
