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

from launch.common import rank_env
from recipes import ConfigError, RunConfig
from resiliency.monitor.fault_tolerance import LAUNCHER_CONFIG_FILE

LAUNCHERS = {"torchrun": "torchrun", "ft_launcher": "ft_launcher"}
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Signals the launcher handles itself. Not SIGTERM/SIGUSR1: torchrun turns those into a Python
# exception raised at an arbitrary point of its main loop, which can wedge it in its own
# shutdown (seen: a leaked Popen lock, then a 180 s hang). It ignores them instead (inherited
# SIG_IGN); Slurm delivers them to every process of the step, so the ranks still get them.
LAUNCHER_SIGNALS = "SIGINT,SIGHUP,SIGQUIT"
# When one rank exits, torchrun SIGTERMs its other local ranks and SIGKILLs them this long
# after (default 30 s): they need their emergency-save timeout plus the step in flight.
STEP_SLACK_S = 60


class _ScriptTemplate(Template):
    delimiter = "@@"  # bash itself uses $, @ and % everywhere


@dataclass(frozen=True)
class ScriptInputs:
    """Everything outside the config that the script pins: paths and provenance."""

    config_path: Path  # the resolved config every node and restart loads
    run_dir: Path
    workdir: Path  # the job's working directory (where output_dir was resolved)
    bin_dir: Path  # python, torchrun and ft_launcher of the environment that submitted
    code_commit: str | None
    image_digest: str | None


def render_sbatch(run: RunConfig, inputs: ScriptInputs) -> str:
    """The complete batch script for ``run``; ConfigError on values that cannot be rendered."""
    slurm, launch = run.launch.slurm, run.launch
    _check_env_names(slurm.env_passthrough)
    _check_unquoted_paths(inputs)
    values = {
        "run_id": run.run_id,
        "sbatch_lines": _sbatch_lines(run, inputs),
        "run_dir": _q(inputs.run_dir),
        "config": _q(inputs.config_path),
        "workdir": _q(inputs.workdir),
        "python": _q(inputs.bin_dir / "python"),
        "max_requeues": str(slurm.max_requeues),
        "code_commit": _q(inputs.code_commit or ""),
        "image_digest": _q(inputs.image_digest or ""),
        "launcher_signals": LAUNCHER_SIGNALS,
        "rank_env": "\n".join(f"export {k}={v}" for k, v in rank_env(run).items())
        or "# (no layout-specific environment)",
        "shutdown_timeout": str(math.ceil(run.resiliency.emergency_save_timeout_s) + STEP_SLACK_S),
        "passthrough": _passthrough_lines(slurm.env_passthrough),
        "srun_args": _srun_args(run),
        "launcher": _launcher(run, inputs),
        "nproc": str(launch.nproc_per_node),
    }
    return _ScriptTemplate(SCRIPT).substitute(values)


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
        f"#SBATCH --nodes={launch.nodes}",
        "#SBATCH --ntasks-per-node=1",
    ]
    if launch.gpus_per_node > 0:
        lines.append(f"#SBATCH --gpus-per-node={launch.gpus_per_node}")
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


def _srun_args(run: RunConfig) -> str:
    slurm = run.launch.slurm
    args = ["--ntasks-per-node=1", "--export=ALL", "--label"]
    if slurm.container_image:
        args.append(f"--container-image={_q(slurm.container_image)}")
        if slurm.container_mounts:
            args.append(f"--container-mounts={_q(','.join(slurm.container_mounts))}")
    return " ".join(args)


def _launcher(run: RunConfig, inputs: ScriptInputs) -> str:
    name = LAUNCHERS[run.launch.backend]
    # Inside a container the image provides the environment; outside, the submitting venv does.
    launcher = name if run.launch.slurm.container_image else _q(inputs.bin_dir / name)
    if run.launch.backend == "ft_launcher":
        # ft_launcher refuses to start without its section/timeout config (written at submit).
        launcher += f" --ft-cfg-path={_q(inputs.run_dir / LAUNCHER_CONFIG_FILE)}"
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
PYTHON=@@{python}
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
SIGNALED_BY=""
SRUN_PID=""
REPEATER_PID=""
on_signal() {
    SIGNALED_BY=$1
    echo "[$(date +%T)] batch shell got SIG$1: SIGTERM to the ranks for an emergency save"
    if [ -n "$SRUN_PID" ] && [ -z "$REPEATER_PID" ]; then
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

# ---------------------------------------------------------------- logs
# One log per job and restart (the --output file above gets everything as well). tee ignores
# TERM so a cancel cannot cut the log (and SIGPIPE this shell) before the end.
mkdir -p "$RUN_DIR/slurm"
exec > >(trap '' TERM INT; exec tee -a "$RUN_DIR/slurm/${SLURM_JOB_ID}-restart-${RESTART}.log") 2>&1

# ---------------------------------------------------------------- environment for every rank
export MCORE_RECIPES_CODE_COMMIT=@@{code_commit}
export MCORE_RECIPES_IMAGE_DIGEST=@@{image_digest}
export OMP_NUM_THREADS=1
export PYTHONUNBUFFERED=1
@@{rank_env}
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
echo "[$(date +%T)] job $SLURM_JOB_ID restart $RESTART on $SLURM_JOB_NODELIST;" \
     "rendezvous $MASTER_ADDR:$MASTER_PORT; commit ${MCORE_RECIPES_CODE_COMMIT:-unknown}"

# ---------------------------------------------------------------- train
# Attempt records up to this id belong to earlier runs; the decision below ignores them.
AFTER_ATTEMPT=$("$PYTHON" -m launch.retry_policy "$RUN_DIR" --newest-attempt)
if [ -z "$SIGNALED_BY" ]; then
    # One task per node: a shell that ignores TERM/USR1 and becomes the launcher, which starts
    # @@{nproc} rank(s) on the node. The ignore is inherited: the launcher survives Slurm's
    # signals and so do helper processes the ranks start early; the ranks install their own
    # handlers once training starts.
    srun @@{srun_args} \
        bash -c 'trap "" TERM USR1; exec "$@"' launcher \
        @@{launcher} --nnodes="$SLURM_NNODES" --nproc-per-node=@@{nproc} \
        --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="$SLURM_JOB_ID" \
        -m pretrain --config "$CONFIG" &
    SRUN_PID=$!
    # A trapped signal interrupts `wait` while srun still runs: keep waiting until it ends.
    while :; do
        wait "$SRUN_PID" && SRUN_RC=0 || SRUN_RC=$?
        kill -0 "$SRUN_PID" 2>/dev/null || break
    done
    if [ -n "$REPEATER_PID" ]; then kill "$REPEATER_PID" 2>/dev/null || true; fi
    echo "[$(date +%T)] srun ended with $SRUN_RC (launcher codes carry no rank exit codes)"
fi

# ---------------------------------------------------------------- requeue or stop
# The trainer's attempt record says how the ranks ended: preempted (exit 75) or an
# infrastructure death -> requeue while SLURM_RESTART_COUNT < max_requeues; finished -> 0;
# deterministic failures (config, user code, numerics, data, ...) -> stop with their code.
DECISION=$("$PYTHON" -m launch.retry_policy "$RUN_DIR" --restart-count "$RESTART" \
    --max-requeues "$MAX_REQUEUES" --after-attempt "$AFTER_ATTEMPT") && RC=0 || RC=$?
echo "[$(date +%T)] retry policy: ${DECISION:-<no decision, exit $RC>}"
case "$DECISION" in
    requeue*)
        if [ "$SIGNALED_BY" = TERM ]; then
            echo "Slurm terminated this job (scancel, preemption or time limit): not requeueing"
            exit 75
        fi
        echo "[$(date +%T)] scontrol requeue $SLURM_JOB_ID (restart $((RESTART + 1)) follows)"
        scontrol requeue "$SLURM_JOB_ID" || { echo "scontrol requeue failed"; exit 75; }
        exit 0
        ;;
    *)
        exit "$RC"
        ;;
esac
"""
