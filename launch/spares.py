"""Hot spare nodes (``launch.slurm.spare_nodes``): what a node does when its worker ends.

The job holds ``launch.nodes + spare_nodes`` nodes and runs one ft_launcher on each with
``--nnodes=N:N``: the first N to join the rendezvous train, the others wait in its redundancy
list. When a worker ends, the worker entrypoint (:mod:`launch.standby.worker`) tells its
node's launcher over ft_launcher's own control socket (``FT_LAUNCHER_IPC_SOCKET``, the
``WorkloadControlRequest`` a rank sends) what the end means:

- killed by a signal nobody relayed to it (SIGKILL from the OOM killer or an operator, SIGSEGV,
  SIGBUS: the fault was on this node) -> ``ExcludeThisNode``: the launcher leaves at its next
  rendezvous and a spare takes the node's ranks; the surviving nodes restart in place and
  restore the newest committed step. One node leaves per in-job round (the first to claim the
  round: when a hang makes every rank monitor SIGKILL its rank, one node, not all, is
  replaced), at most ``spare_nodes`` per job and requeue (each exclusion claims a slot: a file
  created exclusively in the run directory, which every node shares); with none left the node
  rejoins, as it would without spares. The node hosting the rendezvous store (the job's first)
  never leaves: its launcher's store would go with it.
- a planned stop of the whole job (exit 75 after the batch shell got Slurm's warning signal,
  marked in the run directory) or a deterministic failure (a "do not retry" code) ->
  ``ShutdownWorkload``: the launchers end instead of restarting the ranks in the job, and the
  batch script's retry policy decides, as it does without spares.
- anything else (a lost peer, a stop asked for by the launcher) -> nothing: the launchers
  restart the ranks in the job.

An elastic job under Slurm (``parallel.elastic``, :mod:`launch.slurm.elastic`) uses the same
report without the spares: a planned stop or a "do not retry" end shuts the node's launcher
down, and a killed worker is restarted in place (a lost node is a lost launcher; the job goes
on at the smaller size until it returns).

Standard library only until a request is sent (the worker entrypoint starts every rank).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

from pretrain.context import exit_codes
from pretrain.context.run_dir import RunDir

SPARES_ENV = "MCORE_RECIPES_SPARE_NODES"  # the job's spare nodes; unset or 0: no spares
ELASTIC_ENV = "MCORE_RECIPES_ELASTIC"  # "1": an elastic job's node (no spares to exclude to)
RUN_DIR_ENV = "MCORE_RECIPES_RUN_DIR"
IPC_ENV = "FT_LAUNCHER_IPC_SOCKET"  # set by ft_launcher for its ranks
STORE_NODE_ENV = "MCORE_RECIPES_STORE_NODE"  # the node whose launcher hosts the store
ROUND_ENV = "TORCHELASTIC_RESTART_COUNT"  # the launcher's round, set for its workers
EXCLUDE, SHUTDOWN = "exclude", "shutdown"
# Asked to stop by nobody: the kernel (OOM killer), the hardware (bus error) or an operator.
# Not SIGABRT: a survivor's collective watchdog aborts its rank when a peer dies.
NODE_FAULT_SIGNALS = frozenset(
    {signal.SIGKILL, signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE}
)


def enabled() -> bool:
    """The worker's end is reported to its launcher: a job with spares, or an elastic one."""
    reporting = _spares() > 0 or os.environ.get(ELASTIC_ENV) == "1"
    return reporting and bool(os.environ.get(IPC_ENV))


def decide(status: int, stopped: bool, job_stopping: bool) -> str | None:
    """What a worker's end (its wait ``status``) means for this node: EXCLUDE, SHUTDOWN or
    None. ``stopped``: a signal reached the worker's entrypoint (the launcher or Slurm asked the
    worker to stop); ``job_stopping``: the batch shell got Slurm's warning signal."""
    if os.WIFSIGNALED(status):
        return EXCLUDE if not stopped and os.WTERMSIG(status) in NODE_FAULT_SIGNALS else None
    code = os.waitstatus_to_exitcode(status)
    if code in exit_codes.NEVER_RETRIED or (code == exit_codes.REQUEUE and job_stopping):
        return SHUTDOWN
    return None


def after_worker(status: int, stopped: bool, rank: int) -> None:
    """Tell this node's launcher what the worker's end means (a no-op without spares or
    elastic)."""
    if not enabled():
        return
    run_dir, job = RunDir(Path(os.environ.get(RUN_DIR_ENV, "."))), job_key()
    action = decide(status, stopped, run_dir.job_stopping_mark(job).exists())
    if action == EXCLUDE and _spares() == 0:
        action = None  # elastic without spares: the launcher restarts the worker in place
    if action == EXCLUDE:
        try:
            why = _claim(run_dir, job, status, rank)
        except OSError as exc:  # the shared run dir unreachable: stay, as without spares
            why = f"its claim could not be written ({exc})"
        if why:
            _say(f"worker killed on this node ({_describe(status)}), but {why}: it rejoins")
            return
        _say(f"worker killed on this node ({_describe(status)}): leaving the job for a spare")
        _request("ExcludeThisNode", rank, f"worker of rank {rank} killed ({_describe(status)})")
    elif action == SHUTDOWN:
        _say(f"worker ended with {_describe(status)}: the launchers end (no in-job restart)")
        _request("ShutdownWorkload", rank, f"rank {rank} ended with {_describe(status)}")


def job_key() -> str:
    """This job's run of the batch script: its id and restart count (a requeued job keeps its
    id and gets its spares back)."""
    return f"{os.environ.get('SLURM_JOB_ID', '')}-{os.environ.get('SLURM_RESTART_COUNT', '0')}"


def _node() -> str:
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def _claim(run_dir: RunDir, job: str, status: int, rank: int) -> str | None:
    """Claim this round's exclusion and a spare for this node; why not, if it may not leave."""
    node = _node()
    if node == os.environ.get(STORE_NODE_ENV):
        return "it hosts the rendezvous store"
    run_dir.spares_dir.mkdir(parents=True, exist_ok=True)
    round_mark = run_dir.spare_round(job, int(os.environ.get(ROUND_ENV, "0")))
    if not _create(round_mark, node):
        leaving = round_mark.read_text().strip()
        # Another rank of this node got there first: the same launcher, told again.
        return None if leaving == node else f"node {leaving} leaves in this round"
    record = {"node": node, "rank": rank, "worker_end": _describe(status), "at": time.time()}
    for slot in range(_spares()):
        if _create(run_dir.spare_claim(job, slot), json.dumps(record) + "\n"):
            return None
    return f"no spare node left in job {job}"


def _create(path: Path, text: str) -> bool:
    """Write ``path`` if it did not exist (atomically decided by the file system)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as out:
        out.write(text)
    return True


def _request(action: str, rank: int, why: str) -> None:
    """Send ft_launcher's workload control request; a launcher that cannot be told is logged,
    never fatal (the job then restarts or requeues as without spares)."""
    try:
        from nvidia_resiliency_ext.fault_tolerance.data import (
            WorkloadAction,
            WorkloadControlRequest,
        )
        from nvidia_resiliency_ext.fault_tolerance.ipc_connector import IpcConnector

        request = WorkloadControlRequest(getattr(WorkloadAction, action), why)
        IpcConnector(os.environ[IPC_ENV]).send((rank, request))
    except Exception as exc:  # noqa: BLE001 - any failure leaves the default behaviour
        _say(f"could not send {action} to the launcher: {exc!r}")


def _describe(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"signal {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exit {os.waitstatus_to_exitcode(status)}"


def _spares() -> int:
    try:
        return int(os.environ.get(SPARES_ENV, "0"))
    except ValueError:
        return 0


def _say(message: str) -> None:
    print(f"spares: {message}", file=sys.stderr, flush=True)
