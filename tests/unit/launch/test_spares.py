"""Hot spares: how a worker's end is read, the job's exclusion budget, and the request that
reaches a real ft_launcher control socket (nvidia-resiliency-ext's own receiver)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from nvidia_resiliency_ext.fault_tolerance.data import WorkloadAction
from nvidia_resiliency_ext.fault_tolerance.ipc_connector import IpcConnector

from launch import spares
from pretrain.context import exit_codes
from pretrain.context.run_dir import RunDir

# The control request and its receiver are nvrx's: both releases (0.4.1 and 0.7) must take it.
pytestmark = [pytest.mark.current_stack]


def _killed(sig: int) -> int:
    return sig  # a wait status: terminated by `sig`, no core


def _exited(code: int) -> int:
    return code << 8


@pytest.mark.parametrize(
    "status, stopped, stopping, expected",
    [
        (_killed(signal.SIGKILL), False, False, spares.EXCLUDE),  # OOM killer, operator, fault
        (_killed(signal.SIGBUS), False, False, spares.EXCLUDE),
        (_killed(signal.SIGABRT), False, False, None),  # a survivor's watchdog, after a peer
        (_killed(signal.SIGKILL), True, False, None),  # the launcher's SIGKILL after its TERM
        (_killed(signal.SIGTERM), False, False, None),  # someone asked it to stop
        (_exited(exit_codes.INFRASTRUCTURE), False, False, None),  # a lost peer: restart here
        (_exited(exit_codes.REQUEUE), True, False, None),  # the launcher stopped it: restart
        (_exited(exit_codes.REQUEUE), True, True, spares.SHUTDOWN),  # Slurm's warning: requeue
        (_exited(exit_codes.USER_CODE), False, False, spares.SHUTDOWN),  # fails anywhere
        (_exited(exit_codes.OK), False, False, None),
    ],
)
def test_a_workers_end_is_read(status: int, stopped: bool, stopping: bool, expected) -> None:
    assert spares.decide(status, stopped, stopping) == expected


@pytest.fixture()
def launcher_socket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """ft_launcher's control socket, received by nvrx's own connector as the launcher does."""
    path = str(tmp_path / "ft_launcher.socket")
    receiver = IpcConnector(path)
    receiver.start_receiving()
    run_dir = tmp_path / "run"
    monkeypatch.setenv(spares.IPC_ENV, path)
    monkeypatch.setenv(spares.SPARES_ENV, "1")
    monkeypatch.setenv(spares.RUN_DIR_ENV, str(run_dir))
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # requeued once: a budget of its own
    monkeypatch.setenv(spares.ROUND_ENV, "0")
    monkeypatch.setenv(spares.STORE_NODE_ENV, "node1")
    monkeypatch.setenv("SLURMD_NODENAME", "node2")
    yield receiver, RunDir(run_dir)
    receiver.stop_receiving()


def _received(receiver: IpcConnector, timeout: float = 5.0) -> list:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = receiver.fetch_received()
        if got:
            return got
        time.sleep(0.05)
    return []


def test_a_killed_worker_takes_the_one_spare_once(launcher_socket, monkeypatch, capfd) -> None:
    receiver, run_dir = launcher_socket
    spares.after_worker(_killed(signal.SIGKILL), stopped=False, rank=3)
    [(rank, request)] = _received(receiver)
    assert (rank, request.action) == (3, WorkloadAction.ExcludeThisNode)
    claim = json.loads(run_dir.spare_claim("77-1", 0).read_text())
    assert (claim["node"], claim["rank"], claim["worker_end"]) == ("node2", 3, "signal SIGKILL")
    # Another rank of the same node in the same round: its launcher is told again.
    spares.after_worker(_killed(signal.SIGKILL), stopped=False, rank=2)
    [(_, again)] = _received(receiver)
    assert again.action == WorkloadAction.ExcludeThisNode
    # The job's one spare is taken: a node whose worker is killed in a later round rejoins.
    monkeypatch.setenv("SLURMD_NODENAME", "node3")
    monkeypatch.setenv(spares.ROUND_ENV, "1")
    spares.after_worker(_killed(signal.SIGKILL), stopped=False, rank=1)
    assert _received(receiver, timeout=0.5) == []
    assert "no spare node left in job 77-1" in capfd.readouterr().err


def test_one_node_leaves_per_round(launcher_socket, monkeypatch, capfd) -> None:
    """A hang: every rank monitor SIGKILLs its rank; the first node to claim the round leaves,
    the others rejoin (one spare spent, not all)."""
    receiver, run_dir = launcher_socket
    monkeypatch.setenv(spares.SPARES_ENV, "3")
    spares.after_worker(_killed(signal.SIGKILL), stopped=False, rank=1)
    monkeypatch.setenv("SLURMD_NODENAME", "node3")
    spares.after_worker(_killed(signal.SIGKILL), stopped=False, rank=2)
    assert [r.action for _, r in _received(receiver)] == [WorkloadAction.ExcludeThisNode]
    assert _received(receiver, timeout=0.3) == []
    assert "node node2 leaves in this round" in capfd.readouterr().err
    assert not run_dir.spare_claim("77-1", 1).exists()


def test_the_store_host_never_leaves(launcher_socket, monkeypatch, capfd) -> None:
    receiver, run_dir = launcher_socket
    monkeypatch.setenv("SLURMD_NODENAME", "node1")
    spares.after_worker(_killed(signal.SIGKILL), stopped=False, rank=0)
    assert _received(receiver, timeout=0.3) == []
    assert "it hosts the rendezvous store: it rejoins" in capfd.readouterr().err


def test_a_planned_stop_ends_the_launchers(launcher_socket) -> None:
    receiver, run_dir = launcher_socket
    run_dir.job_stopping_mark("77-1").parent.mkdir(parents=True)
    run_dir.job_stopping_mark("77-1").touch()
    spares.after_worker(_exited(exit_codes.REQUEUE), stopped=True, rank=0)
    [(_, request)] = _received(receiver)
    assert request.action == WorkloadAction.ShutdownWorkload


def test_without_spares_nothing_is_sent(launcher_socket, monkeypatch) -> None:
    receiver, run_dir = launcher_socket
    monkeypatch.setenv(spares.SPARES_ENV, "0")
    spares.after_worker(_killed(signal.SIGKILL), stopped=False, rank=0)
    assert _received(receiver, timeout=0.3) == [] and not run_dir.spares_dir.exists()
    monkeypatch.setenv(spares.SPARES_ENV, "1")
    monkeypatch.delenv(spares.IPC_ENV)  # torchrun, not ft_launcher: no control socket
    assert not spares.enabled()
    assert os.environ.get(spares.IPC_ENV) is None


def test_an_elastic_node_reports_stops_but_never_leaves(launcher_socket, monkeypatch) -> None:
    """parallel.elastic under Slurm, no spares: a killed worker is restarted in place (no claim,
    no request); a planned stop and a "do not retry" end still end the node's launcher."""
    receiver, run_dir = launcher_socket
    monkeypatch.setenv(spares.SPARES_ENV, "0")
    monkeypatch.setenv(spares.ELASTIC_ENV, "1")
    spares.after_worker(_killed(signal.SIGKILL), stopped=False, rank=1)
    assert _received(receiver, timeout=0.3) == [] and not run_dir.spares_dir.exists()
    spares.after_worker(_exited(exit_codes.USER_CODE), stopped=False, rank=1)
    [(_, request)] = _received(receiver)
    assert request.action == WorkloadAction.ShutdownWorkload
