"""Render the sbatch script for one run: a pure function of the resolved config and paths.

The script is meant to be read by people: every section says what it does and why. It runs one
launcher (torchrun or ft_launcher) per node under ``srun``, turns Slurm's warning signal into
an emergency save, and asks ``python -m launch.retry_policy`` whether to requeue itself.
"""

from __future__ import annotations

import math
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from string import Template

from launch import spares
from launch.common import rank_env, uploader_args, worker_module
from launch.elastic import nodes_it_may_lose, workers_stop_timeout_s
from launch.slurm import elastic
from launch.standby.protocol import SOCKET_ENV
from launch.standby.protocol import address as standby_address
from pretrain.context import exit_codes
from pretrain.context.run_dir import RunDir
from recipes import ConfigError, RunConfig
from recipes.validate import transformer_engine_needs
from resiliency.monitor.fault_tolerance import LAUNCHER_CONFIG_FILE

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Signals the launcher handles itself. Not SIGTERM/SIGUSR1: torchrun turns those into a Python
# exception raised at an arbitrary point of its main loop, which can wedge it in its own
# shutdown (seen: a leaked Popen lock, then a 180 s hang). It ignores them instead (inherited
# SIG_IGN); Slurm delivers them to every process of the step, so the ranks still get them.
LAUNCHER_SIGNALS = "SIGINT,SIGHUP,SIGQUIT"
# When one rank exits, torchrun SIGTERMs its other local ranks and SIGKILLs them this long
# after (default 30 s): they need their emergency-save timeout plus the step in flight.
STEP_SLACK_S = 60
# Counts from the allocation, not the submission: a requeued job that shrank (NumNodes
# update) still carries the submitted task count in its environment.
ONE_TASK_PER_NODE = ('--nodes="$SLURM_NNODES"', '--ntasks="$SLURM_NNODES"', "--ntasks-per-node=1")


# A multi-node GPU job's NCCL environment, each only where the submitting environment
# (--export=ALL) and launch.slurm.env leave it unset. The first three are what Megatron-Bridge's
# Slurm executor sets for its jobs (scripts/performance/utils/executors.py, PERF_ENV_VARS).
NCCL_DEFAULTS = {
    # NCCL's buffers are freed when their collective ends, not held by record_stream
    "TORCH_NCCL_AVOID_RECORD_STREAMS": "1",
    # NCCL's kernels on high-priority CUDA streams, ahead of the compute they overlap
    "TORCH_NCCL_HIGH_PRIORITY": "1",
    # no NVLink SHARP: its buffers' GPU memory goes to the model
    "NCCL_NVLS_ENABLE": "0",
    # a failed or timed-out collective ends the rank (torch's default since 2.2; an image with
    # an older torch would hang until the time limit): the job's retry policy takes over
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
    # InfiniBand's ack timeout 4.096 us x 2^22 = 17 s (NCCL's default 20: 4.3 s): congestion
    # on a large fabric is retried instead of failing the collective
    "NCCL_IB_TIMEOUT": "22",
    # NCCL's own warnings and errors in the job's log, for the post-mortem
    "NCCL_DEBUG": "WARN",
}

# The NCCL environment the ranks get, on one line of the job's log.
SHOW_NCCL_ENV = (
    "echo \"NCCL environment: $(env | grep -E '^(TORCH_)?NCCL_' | sort | tr '\\n' ' ')\""
)


class _ScriptTemplate(Template):
    delimiter = "@@"  # bash itself uses $, @ and % everywhere


@dataclass(frozen=True)
class ScriptInputs:
    """Everything outside the config that the script pins: paths and provenance."""

    config_path: Path  # the resolved config every node and restart loads
    run_dir: Path
    workdir: Path  # the job's working directory (where output_dir was resolved)
    # python, torchrun and ft_launcher of the environment that submitted (the job's, unless
    # launch.slurm.python names another or a container image brings its own)
    bin_dir: Path
    code_commit: str | None
    image_digest: str | None


def env_python(run: RunConfig, inputs: ScriptInputs) -> str:
    """The python outside a container, quoted: launch.slurm.python, else the submitting
    environment's."""
    return _q(run.launch.slurm.python or inputs.bin_dir / "python")


def environment_warning(run: RunConfig, bin_dir: Path) -> str | None:
    """For a GPU job that names no environment of the cluster's (no container image, no
    launch.slurm.python): what it would run with, and the two fixes; None otherwise."""
    slurm = run.launch.slurm
    if run.launch.gpus_per_node == 0 or slurm.container_image or slurm.python:
        return None
    needs = transformer_engine_needs(run)
    te = f" and Transformer Engine (for {', '.join(needs)})" if needs else ""
    return (
        "a GPU job without launch.slurm.container_image or launch.slurm.python runs the "
        f"submitting environment ({bin_dir}) on the cluster's nodes: it needs a CUDA build of "
        f"torch there{te}, which cannot be checked from here (the job's preflight checks each "
        "node and stops the job with exit 2 where it is missing); set "
        "launch.slurm.container_image=NAME@sha256:DIGEST (the job runs the image's "
        "environment) or launch.slurm.python=/path/on/the/cluster/bin/python (an environment "
        "of the cluster's)"
    )


def runs_image_code(run: RunConfig) -> bool:
    """The job runs the container image's installed code (not a mounted checkout)."""
    return bool(run.launch.slurm.container_image) and not run.launch.slurm.mount_code


def _code_commit_line(run: RunConfig, inputs: ScriptInputs) -> str:
    if runs_image_code(run):  # the image knows its own commit (docker/install.sh)
        return "unset MCORE_RECIPES_CODE_COMMIT  # the image's code runs: its build's commit"
    return f"export MCORE_RECIPES_CODE_COMMIT={_q(inputs.code_commit or '')}"


def render_sbatch(run: RunConfig, inputs: ScriptInputs) -> str:
    """The complete batch script for ``run``; ConfigError on values that cannot be rendered."""
    slurm, launch = run.launch.slurm, run.launch
    _check_env_names(slurm.env_passthrough)
    _check_env_names(list(slurm.env))
    _check_unquoted_paths(inputs)
    values = {
        "run_id": run.run_id,
        "sbatch_lines": _sbatch_lines(run, inputs),
        "run_dir": _q(inputs.run_dir),
        "config": _q(inputs.config_path),
        "workdir": _q(inputs.workdir),
        "max_requeues": str(slurm.max_requeues),
        "code_commit_line": _code_commit_line(run, inputs),
        "image_digest": _q(inputs.image_digest or slurm.container_image or ""),
        "launcher_signals": LAUNCHER_SIGNALS,
        "rank_env": "\n".join(
            f"export {k}={_q(v)}" for k, v in {**rank_env(run), **slurm.env}.items()
        )
        or "# (no layout-specific environment)",
        "nccl_env": _nccl_env(run),
        "preflight": _preflight(run, inputs),
        "shutdown_timeout": str(math.ceil(run.resiliency.emergency_save_timeout_s) + STEP_SLACK_S),
        "passthrough": _passthrough_lines(slurm.env_passthrough),
        "train_step": _train_step(run, inputs),
        "after_train": _after_train(run),
        "tokens_per_step": str(run.tokens_per_step),
        **_spare_values(run),
        "nproc": str(launch.nproc_per_node),
        **_health_values(run, inputs),
        **_standby_values(run, inputs),
        "uploader_start": _uploader_start(run, inputs),
        "remote_behind": str(exit_codes.REMOTE_BEHIND),
        "interrupted": str(exit_codes.INTERRUPTED),
    }
    return _ScriptTemplate(SCRIPT).substitute(values)


def _nccl_env(run: RunConfig) -> str:
    """NCCL_DEFAULTS for a GPU job across nodes (one node has no fabric to tune), each kept
    when already set; then the NCCL environment every rank gets, in the job's log."""
    launch = run.launch
    if launch.gpus_per_node == 0 or launch.nodes + launch.slurm.spare_nodes < 2:
        return "# (not a multi-node GPU job: no NCCL defaults)"
    lines = ["# NCCL defaults for a multi-node GPU job; a value already set is kept"]
    for name, value in NCCL_DEFAULTS.items():
        if name not in launch.slurm.env:  # set above, verbatim
            lines.append(f"export {name}=${{{name}:-{value}}}")
    lines.append(SHOW_NCCL_ENV)
    return "\n".join(lines)


def _uploader_start(run: RunConfig, inputs: ScriptInputs) -> str:
    args = uploader_args(run, "$RUN_DIR", follow=False)
    if args is None:
        return "# (checkpoint.remote is off: no uploader)"
    container = container_args(run, inputs)
    one_task = ["--overlap", "--nodes=1", "--ntasks=1", "--cpus-per-task=1", *container]
    runner = f"srun {' '.join(one_task)} python" if container else env_python(run, inputs)
    quoted = " ".join('"$RUN_DIR"' if a == "$RUN_DIR" else _q(a) for a in args)
    interval = f"{run.checkpoint.remote.follow_interval_s:g}"
    return (
        f"UPLOAD=({runner} {quoted})\nFOLLOW_INTERVAL={interval}\nfollow_uploads &\nUPLOADER_PID=$!"
    )


def _standby_values(run: RunConfig, inputs: ScriptInputs) -> dict[str, str]:
    """launch.standby: each node's launcher task starts its node's standby server first (in
    the step: it ends with the launcher); every process of the task finds it by name."""
    if not run.launch.standby:
        return {"standby_start": "", "standby_env": "# (launch.standby is off)"}
    python = "python" if container_args(run, inputs) else env_python(run, inputs)
    # Exported, not spliced into the task's single-quoted `bash -c` (quotes cannot nest).
    return {
        "standby_start": '"$MCORE_RECIPES_STANDBY_PYTHON" -m launch.standby.server "$RUN_DIR" & ',
        "standby_env": f"export RUN_DIR MCORE_RECIPES_STANDBY_PYTHON={python}\n"
        f"export {SOCKET_ENV}={_q(standby_address(inputs.run_dir))}",
    }


def _nodes_lines(run: RunConfig) -> list[str]:
    spare = run.launch.slurm.spare_nodes
    if run.parallel.elastic:
        return [
            f"#SBATCH --nodes={run.launch.nodes}",
            f"# parallel.elastic: the job trains on as few as {run.launch.min_nodes} node(s);",
            "# Slurm must not end it when one of its nodes fails",
            "#SBATCH --no-kill",
        ]
    if not spare:
        return [f"#SBATCH --nodes={run.launch.nodes}"]
    return [
        f"# {run.launch.nodes} node(s) train, {spare} spare(s) wait in the rendezvous to replace",
        "# a failed one inside the job (launch.slurm.spare_nodes): Slurm must not end the job",
        "# when one of its nodes fails",
        f"#SBATCH --nodes={run.launch.nodes + spare}",
        "#SBATCH --no-kill",
    ]


def _nnodes(run: RunConfig) -> str:
    """The launcher's --nnodes: every node of the allocation (a requeued job may have shrunk),
    or exactly launch.nodes out of an allocation with spares (the rest wait as spares)."""
    if run.launch.slurm.spare_nodes:
        return f"{run.launch.nodes}:{run.launch.nodes}"
    return '"$SLURM_NNODES"'


def _spare_values(run: RunConfig) -> dict[str, str]:
    """With spares every node's worker entrypoint reports how its worker ended (launch.spares),
    the batch shell marks a planned stop of the job, and srun lets a node's launcher leave."""
    spare = run.launch.slurm.spare_nodes
    if not spare and not run.parallel.elastic:
        return {"spares_env": "# (no spare nodes)", "mark_stopping": "", "store_node": ""}
    mark = _stopping_mark()
    if spare:
        report = f"{spares.SPARES_ENV}={spare}"
        store_node = (
            "# the first node's launcher hosts the store: with spares it never leaves\n"
            f'export {spares.STORE_NODE_ENV}="$MASTER_NODE"\n'
        )
    else:  # parallel.elastic: the same report, without spares to leave for
        report, store_node = f"{spares.ELASTIC_ENV}=1", ""
    return {
        "spares_env": f'export {report} {spares.RUN_DIR_ENV}="$RUN_DIR"',
        # In the trap, under `set -e`: a failed mark must not end the shell before the save.
        "mark_stopping": f'    {{ mkdir -p "$(dirname "{mark}")" && touch "{mark}"; }} '
        '|| echo "warning: cannot mark the job stopping"\n',
        "store_node": store_node,
    }


def _train_step(run: RunConfig, inputs: ScriptInputs) -> str:
    """The training command, started in the background: one ``srun`` step with a launcher on
    every node, or, with parallel.elastic, the supervisor of one step per node."""
    tail = f'-m {worker_module(run)} --config "$CONFIG" &'
    if not run.parallel.elastic:
        return (
            f"srun {_srun_args(run, inputs)} \\\n"
            f'        bash -c \'trap "" TERM USR1; {_standby_values(run, inputs)["standby_start"]}'
            'exec "$@"\' launcher \\\n'
            f"        {_launcher(run, inputs)} --nnodes={_nnodes(run)} "
            f"--nproc-per-node={run.launch.nproc_per_node} \\\n"
            '        --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" '
            '--rdzv-id="$SLURM_JOB_ID" \\\n'
            f"        {tail}"
        )
    step = [
        "srun",
        "--nodes=1",
        "--ntasks=1",
        f"--nodelist={elastic.NODE}",
        f"--cpus-per-task={srun_cpus(run)}",
        "--kill-on-bad-exit=0",
        "--export=ALL",
    ]
    return (
        "# parallel.elastic: a step of its own per node, started again on its node after it\n"
        "    # ends (python -m launch.slurm.elastic); the first node's step is the job's\n"
        f'    {env_python(run, inputs)} -m launch.slurm.elastic --config "$CONFIG" \\\n'
        '        --nodes "$(scontrol show hostnames "$SLURM_JOB_NODELIST")" \\\n'
        '        --endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "$SLURM_JOB_ID" \\\n'
        f'        --stop-mark "{_stopping_mark()}" -- \\\n'
        f"        {' '.join(step)} \\\n"
        '        bash -c \'trap "" TERM USR1; exec "$@"\' launcher \\\n'
        f"        {_launcher(run, inputs)} {elastic.RENDEZVOUS} "
        f"--nproc-per-node={run.launch.nproc_per_node} \\\n"
        f"        {tail}"
    )


def _after_train(run: RunConfig) -> str:
    """parallel.elastic: no node's step outlives the supervisor (killed, it would leave them
    holding their nodes through the health check and the requeue)."""
    if not run.parallel.elastic:
        return ""
    return (
        "    # parallel.elastic: cancel any node step the supervisor left (it ends them itself\n"
        "    # unless it was killed)\n"
        '    for step in $(squeue -h -s -j "$SLURM_JOB_ID" -o %i 2>/dev/null '
        "| grep -E '[.][0-9]+$' || true); do\n"
        '        scancel "$step" || echo "warning: cannot cancel step $step"\n'
        "    done\n"
    )


def _stopping_mark() -> str:
    """The file the batch shell creates when Slurm warned it (the job stops as a whole)."""
    return str(RunDir(Path("$RUN_DIR")).job_stopping_mark("${SLURM_JOB_ID}-${RESTART}"))


def _preflight(run: RunConfig, inputs: ScriptInputs) -> str:
    """A GPU job's check of its environment on every node (launch/slurm/preflight.py), in the
    container when there is one; a failure stops the job with CONFIG_ERROR, before the health
    check, the training step and the retry policy (which would requeue it)."""
    gpus = run.launch.gpus_per_node
    if gpus == 0:  # CPU nodes: any torch build runs the job
        return "# (a CPU job: no preflight)"
    container = container_args(run, inputs)
    srun = [*ONE_TASK_PER_NODE, f"--cpus-per-task={srun_cpus(run)}", "--kill-on-bad-exit=0"]
    srun += ["--export=ALL", "--label", *container]
    python = "python" if container else env_python(run, inputs)
    needs = transformer_engine_needs(run)
    need_te = f" --need-te={_q(','.join(needs))}" if needs else ""
    code = exit_codes.CONFIG_ERROR
    return (
        "# Once per node, before anything else runs with the job's environment (the health\n"
        "# check, the retry policy and the ranks all do): a CUDA build of torch that sees the\n"
        "# node's GPUs, and Transformer Engine where the recipe needs it. A failure is the\n"
        f"# environment's, not the node's: the job stops with exit {code}, never requeued.\n"
        'if [ -z "$SIGNALED_BY" ]; then\n'
        f"    srun {' '.join(srun)} \\\n"
        f"        {python} -m launch.slurm.preflight --gpus {gpus}{need_te} \\\n"
        "        && PREFLIGHT_RC=0 || PREFLIGHT_RC=$?\n"
        '    if [ "$PREFLIGHT_RC" != 0 ]; then\n'
        "        echo \"[$(date +%T)] preflight FAILED (exit $PREFLIGHT_RC): the job's environment"
        f' cannot run it; exit {code}, not requeued"\n'
        f"        exit {code}\n"
        "    fi\n"
        "fi"
    )


def _health_values(run: RunConfig, inputs: ScriptInputs) -> dict[str, str]:
    slurm = run.launch.slurm
    container = container_args(run, inputs)
    host_python = env_python(run, inputs)
    # Inside a container the image's python runs every step; a one-task step on the batch
    # node runs the retry policy there too.
    one_task = ["--nodes=1", "--ntasks=1", f"--cpus-per-task={srun_cpus(run)}", *container]
    health = [*ONE_TASK_PER_NODE, f"--cpus-per-task={srun_cpus(run)}"]
    health += ["--kill-on-bad-exit=0", "--export=ALL", "--label", *container]
    return {
        "policy_runner": f"srun {' '.join(one_task)} python" if container else host_python,
        "health_runner": "python" if container else host_python,
        "health_srun_args": " ".join(health),
        "health_enabled": "1" if run.resiliency.health.enabled else "0",
        "cpus": srun_cpus(run),
        "nodes": str(run.launch.nodes + slurm.spare_nodes),
        "min_nodes": str(slurm.min_nodes or 0),
        "max_excluded": str(slurm.max_excluded_nodes),
    }


def _q(value: object) -> str:
    return shlex.quote(str(value))


def _check_env_names(names: list[str]) -> None:
    bad = [n for n in names if not _ENV_NAME.match(n)]
    if bad:
        raise ConfigError(
            f"launch.slurm.env_passthrough: {bad} are not environment variable "
            "names (letters, digits and '_', not starting with a digit)"
        )


def _check_unquoted_paths(inputs: ScriptInputs) -> None:
    # sbatch reads "#SBATCH --output=..." without shell quoting.
    for name, path in (("output_dir", inputs.run_dir), ("working directory", inputs.workdir)):
        if re.search(r"\s", str(path)):
            raise ConfigError(
                f"{name} {str(path)!r} contains whitespace, which #SBATCH lines "
                "cannot quote; choose a path without spaces"
            )


def _sbatch_lines(run: RunConfig, inputs: ScriptInputs) -> str:
    slurm, launch = run.launch.slurm, run.launch
    lines = [
        "# one task per node: it runs the launcher, which starts the node's ranks",
        f"#SBATCH --job-name={run.run_id}",
        *_nodes_lines(run),
        "#SBATCH --ntasks-per-node=1",
    ]
    if launch.gpus_per_node > 0:
        lines.append(f"#SBATCH --gpus-per-node={launch.gpus_per_node}")
    lines += _resource_lines(run)
    lines.append(f"#SBATCH --time={slurm.time_limit}")
    if slurm.partition:
        lines.append(f"#SBATCH --partition={slurm.partition}")
    if slurm.account:
        lines.append(f"#SBATCH --account={slurm.account}")
    lines += [
        f"# USR1 to this shell only (B:), {slurm.signal_grace_s} s before the time limit:",
        "# the window for an emergency save before Slurm kills the job",
        f"#SBATCH --signal=B:USR1@{slurm.signal_grace_s}",
        "# this script requeues itself (scontrol requeue) after planned exits and crashes;",
        "# a requeued run appends to the same output file",
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
        f"#SBATCH --output={inputs.run_dir}/slurm/%x-%j.out",
        f"#SBATCH --chdir={inputs.workdir}",
        "# the submitting environment reaches the job (env_passthrough names are checked below)",
        "#SBATCH --export=ALL",
    ]
    if slurm.extra_sbatch:
        lines.append("# launch.slurm.extra_sbatch, verbatim")
        lines += [f"#SBATCH {arg}" for arg in slurm.extra_sbatch]
    return "\n".join(lines)


def _resource_lines(run: RunConfig) -> list[str]:
    """CPUs and memory of each node's one task. Without them a task gets one CPU, and with
    task binding the node's ranks all share it."""
    slurm, launch = run.launch.slurm, run.launch
    lines = []
    if launch.slurm_exclusive:
        lines += ["# whole nodes: every CPU and all memory", "#SBATCH --exclusive"]
    cpus = slurm.cpus_per_task or (None if launch.slurm_exclusive else launch.nproc_per_node)
    if cpus is not None:
        lines.append(f"#SBATCH --cpus-per-task={cpus}")
    mem = slurm.mem if slurm.mem is not None else ("0" if launch.slurm_exclusive else None)
    if mem is not None:
        lines.append(f"#SBATCH --mem={mem}")
    return lines


def srun_cpus(run: RunConfig) -> str:
    """srun's --cpus-per-task: since Slurm 22.05 srun no longer inherits the job's
    --cpus-per-task (SLURM_CPUS_PER_TASK is ignored), so every step passes it again."""
    launch = run.launch
    if launch.slurm.cpus_per_task:
        return str(launch.slurm.cpus_per_task)
    return '"$SLURM_CPUS_ON_NODE"' if launch.slurm_exclusive else str(launch.nproc_per_node)


def _passthrough_lines(names: list[str]) -> str:
    if not names:
        return "# (launch.slurm.env_passthrough is empty)"
    # Values come from the submitting environment via --export=ALL, never from this file:
    # it may hold tokens that must not land in the run directory.
    return "\n".join(
        f'if [ -n "${{{n}+set}}" ]; then export {n}; '
        f'else echo "warning: env_passthrough {n} is not set in the submitting environment"; fi'
        for n in names
    )


def _srun_args(run: RunConfig, inputs: ScriptInputs) -> str:
    # --kill-on-bad-exit: a node whose launcher failed ends the step at once, instead of the
    # other nodes waiting on collectives for the timeout (ranks exit only after a save's
    # publish, so this never cuts one short). --wait: the rest get 60 s after the first exits.
    # With spares, neither: a node lost whole (its launcher killed with everything under it)
    # must leave the step to the others, whose launchers restart the ranks with a spare.
    spares = run.launch.slurm.spare_nodes > 0
    args = [
        *ONE_TASK_PER_NODE,
        f"--cpus-per-task={srun_cpus(run)}",
        "--kill-on-bad-exit=0" if spares else "--kill-on-bad-exit=1",
        "--wait=0" if spares else "--wait=60",
        "--export=ALL",
        "--label",
    ]
    return " ".join(args + container_args(run, inputs))


def container_mounts(run: RunConfig, inputs: ScriptInputs) -> list[str]:
    """The user's mounts plus every host path the job reads or writes, at the same path in the
    container: the run dir (pinned config, checkpoints, logs), the working directory, the data
    and tokenizer, the local tier."""
    given = list(run.launch.slurm.container_mounts)
    covered = [m.split(":")[1] if ":" in m else m for m in given]
    paths = [inputs.run_dir.parent] + ([] if runs_image_code(run) else [inputs.workdir])
    paths += [Path(p).parent for p in run.data.paths if Path(p).is_absolute()]
    for extra in (run.data.tokenizer_path, run.checkpoint.local.dir, run.data.cache_dir):
        if extra and Path(extra).is_absolute():
            paths.append(Path(extra))
    for path in paths:
        if not any(path == Path(c) or Path(c) in path.parents for c in covered):
            given.append(f"{path}:{path}")
            covered.append(str(path))
    return given


def pyxis_image(image: str) -> str:
    """An image reference as pyxis/enroot take it: ``[USER@][REGISTRY#]IMAGE[:TAG|@DIGEST]``.

    An OCI reference names its registry before the first ``/`` (a name with a ``.`` or a
    ``:``, or ``localhost``, as Docker reads it); enroot reads a reference without ``#`` as a
    Docker Hub image, so ``nvcr.io/nvidia/pytorch:25.01-py3`` would be looked up as the Hub's
    ``nvcr.io/nvidia/pytorch``: it becomes ``nvcr.io#nvidia/pytorch:25.01-py3`` (a digest is
    kept). A pyxis reference (with ``#``), a Docker Hub name and a local squashfs path are
    left as they are."""
    ref = image.removeprefix("docker://")
    if _not_oci(ref):
        return image
    user, at, rest = ref.partition("@")
    if not at or "/" in user:  # the "@" is a digest's, not a user's
        user, rest = "", ref
    registry, slash, path = rest.partition("/")
    if not slash or not ("." in registry or ":" in registry or registry == "localhost"):
        return image  # a Docker Hub name (library/ubuntu, nvidia/cuda:12.4.1-base)
    return f"{user}{'@' if user else ''}{registry}#{path}"


def _not_oci(ref: str) -> bool:
    """Already pyxis syntax (``#``), another enroot scheme (``dockerd://``) or a file."""
    file = ref.startswith(("/", ".", "~")) or ref.endswith((".sqsh", ".squashfs"))
    return "#" in ref or "://" in ref or file


def container_args(run: RunConfig, inputs: ScriptInputs) -> list[str]:
    """pyxis flags for a step; empty without launch.slurm.container_image. Every step of the
    job (health check, training, retry policy) runs in one named container, imported once."""
    slurm = run.launch.slurm
    if not slurm.container_image:
        return []
    # The image's code runs from the run dir: a checkout as cwd would shadow the package.
    default = inputs.run_dir if runs_image_code(run) else inputs.workdir
    workdir = slurm.container_workdir or str(default)
    return [
        f"--container-image={_q(pyxis_image(slurm.container_image))}",
        f"--container-name={_q('mcore-recipes-' + str(run.run_id))}",
        f"--container-mounts={_q(','.join(container_mounts(run, inputs)))}",
        f"--container-workdir={_q(workdir)}",
        "--no-container-mount-home",
    ]


def _launcher(run: RunConfig, inputs: ScriptInputs) -> str:
    """torchrun or ft_launcher, through ``python -m launch.torchrun``: the same launcher,
    in-process, whose stop by a signal (a user's SIGINT) is one line rather than torch
    elastic's SignalException traceback, and whose exit code is the failing rank's. Inside a
    container the image provides the environment; outside, launch.slurm.python's or the
    submitting one's."""
    python = "python" if run.launch.slurm.container_image else env_python(run, inputs)
    launcher = f"{python} -m launch.torchrun"
    if run.launch.backend == "ft_launcher":
        launcher += " --ft-launcher"
        # ft_launcher refuses to start without its section/timeout config (written at submit).
        launcher += f" --ft-cfg-path={_q(inputs.run_dir / LAUNCHER_CONFIG_FILE)}"
        launcher += f" --workers-stop-timeout={workers_stop_timeout_s(run):g}"
    if run.launch.slurm.spare_nodes:
        # the ranks restart in the job (on a spare) instead of the job requeueing
        launcher += f" --max-restarts={max(run.resiliency.max_restarts, 1)}"
    elif run.parallel.elastic:
        # a lost node fails the survivors' workers once (their restart at the smaller size);
        # a grow is a membership change, which torch elastic does not count
        launcher += f" --max-restarts={run.resiliency.max_restarts + nodes_it_may_lose(run)}"
    return launcher


SCRIPT = r"""#!/bin/bash
# Slurm batch script for run @@{run_id}, rendered by `python -m launch slurm`.
# Resubmit it as is with `sbatch <this file>`; every restart trains the run pinned in
# @@{config}.
#
# ---------------------------------------------------------------- resources and flags
@@{sbatch_lines}

set -euo pipefail

RUN_DIR=@@{run_dir}
CONFIG=@@{config}
MAX_REQUEUES=@@{max_requeues}
RESTART=${SLURM_RESTART_COUNT:-0}
cd @@{workdir}

# ---------------------------------------------------------------- signals
# Slurm warns this shell with USR1 (--signal=B:USR1@grace, or `scancel --signal=USR1 --batch`).
# The ranks must get SIGTERM: emergency save at the next step boundary, then exit 75.
# SIGTERM sent to srun itself would make it SIGKILL its tasks, so signal the job's steps
# through Slurm, which delivers it to every process of the step: the launchers ignore it (see
# "train"), the ranks act on it. Ranks ignore it until their handler is installed (startup,
# restore), so it is repeated every 30 s until srun ends.
# A TERM for this shell means Slurm itself is ending the job (scancel, preemption, time limit):
# forward it too, but leave any requeue to Slurm.
# An INT for this shell (`scancel --signal=INT --batch`, a user's Ctrl-C for a batch job) is
# the user's stop: SIGINT to the ranks once (a second one would stop them at once, without the
# save), exit 130 after their emergency save, never requeued.
SIGNALED_BY=""
SRUN_PID=""
REPEATER_PID=""
on_interrupt() {
    [ -n "$SIGNALED_BY" ] && return 0  # one stop request per job
    SIGNALED_BY=INT
    echo "[$(date +%T)] batch shell got SIGINT: SIGINT to the ranks for an emergency save," \
         "then stop (exit 130, not requeued)"
@@{mark_stopping}    if [ -n "$SRUN_PID" ]; then
        scancel --signal=INT "$SLURM_JOB_ID" || echo "warning: scancel failed"
    fi
}
on_signal() {
    SIGNALED_BY=$1
    echo "[$(date +%T)] batch shell got SIG$1: SIGTERM to the ranks for an emergency save"
@@{mark_stopping}    if [ -n "$SRUN_PID" ] && [ -z "$REPEATER_PID" ]; then
        (
            while kill -0 "$SRUN_PID" 2>/dev/null; do
                scancel --signal=TERM "$SLURM_JOB_ID" || echo "warning: scancel failed"
                sleep 30
            done
        ) &
        REPEATER_PID=$!
    fi
}
trap 'on_signal USR1' USR1
trap 'on_signal TERM' TERM
trap 'on_interrupt' INT

# ---------------------------------------------------------------- logs
# One log per job and restart (the --output file above gets everything as well). tee ignores
# TERM so a cancel cannot cut the log (and SIGPIPE this shell) before the end. A copy goes to
# this node's own disk: the retry policy reads the launchers' exit lines from it, which a full
# run disk would cut from the run dir's copy (tee writes on to the files it still can).
mkdir -p "$RUN_DIR/slurm"
JOB_LOG="$RUN_DIR/slurm/${SLURM_JOB_ID}-restart-${RESTART}.log"
LOCAL_LOG="${TMPDIR:-/tmp}/mcore-recipes-${SLURM_JOB_ID}-restart-${RESTART}.log"
exec > >(trap '' TERM INT; exec tee -a "$JOB_LOG" "$LOCAL_LOG") 2>&1

# ---------------------------------------------------------------- environment for every rank
@@{code_commit_line}
export MCORE_RECIPES_IMAGE_DIGEST=@@{image_digest}
export OMP_NUM_THREADS=1
export PYTHONUNBUFFERED=1
@@{standby_env}
@@{spares_env}
@@{rank_env}
@@{nccl_env}
# The launcher ignores TERM/USR1 (see "train"), so it must not install handlers for them
# (torchrun reads PET_SIGNALS_TO_HANDLE; older releases TORCHELASTIC_SIGNALS_TO_HANDLE). When
# a rank exits it stops the node's other ranks, giving them the emergency-save timeout (plus a
# step) before SIGKILL instead of its default 30 s.
export PET_SIGNALS_TO_HANDLE=@@{launcher_signals}
export TORCHELASTIC_SIGNALS_TO_HANDLE=@@{launcher_signals}
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=@@{shutdown_timeout}
@@{passthrough}

# ---------------------------------------------------------------- rendezvous
# The first node hosts the launcher's c10d store. Use its NodeAddr from Slurm, not its name:
# node names need not resolve. The port depends on the job and restart, so a store lingering
# from the previous restart cannot collide with this one.
MASTER_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)
MASTER_ADDR=$(scontrol show node "$MASTER_NODE" | sed -n 's/.*NodeAddr=\([^ ]*\).*/\1/p')
MASTER_ADDR=${MASTER_ADDR:-$MASTER_NODE}
MASTER_PORT=$(( 20000 + (SLURM_JOB_ID % 2000) * 16 + RESTART % 16 ))
@@{store_node}echo "[$(date +%T)] job $SLURM_JOB_ID restart $RESTART on $SLURM_JOB_NODELIST;" \
     "rendezvous $MASTER_ADDR:$MASTER_PORT; commit ${MCORE_RECIPES_CODE_COMMIT:-unknown}"

# ---------------------------------------------------------------- preflight
@@{preflight}

# ---------------------------------------------------------------- node health
# Every node checks itself (free space, /dev/shm, GPUs, CPUs, the site script) before any
# rank starts, at every restart; the reports go to the attempt record, and a node that fails
# is left out of the requeued job. Where the python runs: launch.slurm.python's environment
# (else the submitting one's), or the container.
policy() { @@{policy_runner} -m launch.retry_policy "$@"; }
health() {
    srun @@{health_srun_args} @@{health_runner} -m resiliency.monitor.health --config "$CONFIG" \
        --cpus @@{cpus} --out "$1"
}
HEALTH_DIR="$RUN_DIR/health/$SLURM_JOB_ID-$RESTART"
export MCORE_RECIPES_HEALTH_DIR="$HEALTH_DIR"
HEALTHY=1
if [ @@{health_enabled} = 1 ] && [ -z "$SIGNALED_BY" ]; then
    health "$HEALTH_DIR" || HEALTHY=0
    echo "[$(date +%T)] node health: $([ "$HEALTHY" = 1 ] && echo ok || echo FAILED) ($HEALTH_DIR)"
fi

# ---------------------------------------------------------------- object-store uploader
# With checkpoint.remote set, committed steps are copied to the object store by a process of
# their own beside the training step (resumable; a copy it misses is made after srun ends).
# The follower is restarted with backoff whenever it dies (exit 6: the run's lease moved to
# another job, whose uploader takes over); the TERM after srun reaches it through the loop.
follow_uploads() {
    local stop= child= rc delay=1
    trap 'stop=1; [ -n "$child" ] && kill -TERM "$child" 2>/dev/null' TERM
    while [ -z "$stop" ]; do
        "${UPLOAD[@]}" --follow --interval="$FOLLOW_INTERVAL" &
        child=$!
        wait "$child" && rc=0 || rc=$?
        if [ -n "$stop" ]; then wait "$child" 2>/dev/null; return 0; fi
        if [ "$rc" = 6 ]; then
            echo "[$(date +%T)] uploader exited 6 (the run's lease moved): not restarted"
            return 0
        fi
        echo "[$(date +%T)] uploader exited $rc; restarting it in ${delay} s"
        sleep "$delay" & wait $! || true
        delay=$(( delay * 2 > 60 ? 60 : delay * 2 ))
    done
}
UPLOADER_PID=
UPLOAD_BEHIND=
@@{uploader_start}

# ---------------------------------------------------------------- train
# Attempt records up to this id belong to earlier runs; the decision below ignores them.
AFTER_ATTEMPT=$(policy "$RUN_DIR" --newest-attempt)
SRUN_RC=0
if [ -z "$SIGNALED_BY" ] && [ "$HEALTHY" = 1 ]; then
    # One task per node: a shell that ignores TERM/USR1 and becomes the launcher, which starts
    # @@{nproc} rank(s) on the node. The ignore is inherited: the launcher survives Slurm's
    # signals and so do helper processes the ranks start early; the ranks install their own
    # handlers once training starts.
    @@{train_step}
    SRUN_PID=$!
    # A trapped signal interrupts `wait` while srun still runs: keep waiting until it ends.
    while :; do
        wait "$SRUN_PID" && SRUN_RC=0 || SRUN_RC=$?
        kill -0 "$SRUN_PID" 2>/dev/null || break
    done
@@{after_train}    if [ -n "$REPEATER_PID" ]; then kill "$REPEATER_PID" 2>/dev/null || true; fi
    echo "[$(date +%T)] srun ended with $SRUN_RC (launcher codes carry no rank exit codes)"
fi
if [ -n "$UPLOADER_PID" ]; then
    kill -TERM "$UPLOADER_PID" 2>/dev/null || true
    wait "$UPLOADER_PID" 2>/dev/null || true
    if ! "${UPLOAD[@]}"; then
        UPLOAD_BEHIND=1
        echo "[$(date +%T)] final upload failed: the object store lacks the newest verified" \
             "step (the next launch's uploader retries)"
    fi
fi
if [ @@{health_enabled} = 1 ] && [ "$SRUN_RC" != 0 ] && [ -z "$SIGNALED_BY" ]; then
    # A node that broke during the run is found in this allocation, not the next one.
    health "$HEALTH_DIR-after" || echo "[$(date +%T)] node health after the failure: FAILED"
fi

# ---------------------------------------------------------------- requeue or stop
# The trainer's attempt record says how the ranks ended: preempted (exit 75) or an
# infrastructure death -> requeue while SLURM_RESTART_COUNT < max_requeues; finished -> 0;
# deterministic failures (config, user code, numerics, data, ...) -> stop with their code.
# Failure requeues are counted in the run's ledger (slurm/requeues.jsonl) apart from planned
# ones (time limit, preemption), which are never limited. Nodes that failed the health check
# are excluded from the requeued job, within launch.slurm.max_excluded_nodes and never below
# the nodes the job needs; with launch.slurm.min_nodes it may shrink instead of waiting.
PARTITION_NODES=$(sinfo -h -p "${SLURM_JOB_PARTITION:-}" -o %D 2>/dev/null \
    | awk '{s += $1} END {print s + 0}')
POLICY_OUT=$(policy "$RUN_DIR" --restart-count "$RESTART" --max-requeues "$MAX_REQUEUES" \
    --after-attempt "$AFTER_ATTEMPT" --job-id "$SLURM_JOB_ID" \
    --job-log "$LOCAL_LOG" --job-log "$JOB_LOG" \
    --tokens-per-step @@{tokens_per_step} \
    --health-dir "$HEALTH_DIR" --health-dir "$HEALTH_DIR-after" --job-nodes "$SLURM_NNODES" \
    --launch-nodes @@{nodes} --min-nodes @@{min_nodes} --max-excluded @@{max_excluded} \
    --partition-nodes "$PARTITION_NODES" --cpus-per-task "${SLURM_CPUS_PER_TASK:-1}") \
    && RC=0 || RC=$?
rm -f "$LOCAL_LOG"  # read; what follows is in the run dir's copy
DECISION=$(sed -n 1p <<<"$POLICY_OUT")
UPDATE=$(sed -n 2p <<<"$POLICY_OUT")
echo "[$(date +%T)] retry policy: ${DECISION:-<no decision, exit $RC>}"
case "$DECISION" in
    requeue*)
        if [ "$SIGNALED_BY" = INT ]; then
            echo "[$(date +%T)] interrupted by the user: not requeued (resubmit to resume)"
            exit @@{interrupted}
        fi
        if [ "$SIGNALED_BY" = TERM ]; then
            echo "Slurm terminated this job (scancel, preemption or time limit): not requeueing"
            exit 75
        fi
        echo "[$(date +%T)] scontrol requeue $SLURM_JOB_ID (restart $((RESTART + 1)) follows)" \
             "${UPDATE:+then scontrol update $UPDATE}"
        # Slurm refuses ExcNodeList for a running job: requeue, then update the pending job.
        # The requeue signals this shell's processes, so both run with TERM ignored. Updates are
        # separated by ';' (a shrink takes two, see launch/requeues.py).
        bash -c 'trap "" TERM
            scontrol requeue "$1" || exit 1
            IFS=";" read -ra updates <<<"$2"
            for update in "${updates[@]}"; do
                scontrol update JobId="$1" $update \
                    || echo "warning: scontrol update JobId=$1 $update failed"
            done' requeue "$SLURM_JOB_ID" "$UPDATE" || { echo "scontrol requeue failed"; exit 75; }
        exit 0
        ;;
    *)
        if [ "$RC" = 0 ] && [ -n "$UPLOAD_BEHIND" ]; then exit @@{remote_behind}; fi
        exit "$RC"
        ;;
esac
"""
