"""Pre-imported standby workers and the recovery ledger (#37).

The standby server is checked from outside (/proc: its threads, sockets and files) before it
forks anything; one real ``launch local`` job under ft_launcher with standby workers has a
random rank's worker SIGKILLed at a random moment, and must (a) train bit for bit as the plain
start of the shared clean run, (b) record a recovery ledger whose phases are all present,
positive and add up to the time this test measured itself between its kill and the new
attempt's first step.
"""

from __future__ import annotations

import ctypes.util
import os
import random
import signal
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from bench.recovery import kill_and_watch
from launch.standby import protocol
from resiliency.monitor.recovery import PHASES
from tests.ft_helpers import attempts, base_overrides, clean_run, env, launch_cmd
from tests.helpers import REPO, losses


def _server(run_dir: Path, extra_env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "launch.standby.server", str(run_dir)],
        cwd=REPO,
        env={**env(), **(extra_env or {})},
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_ready(server: subprocess.Popen) -> str:
    assert server.stderr is not None
    for line in server.stderr:
        if "standby:" in line and ("ready" in line or "not fork-safe" in line):
            return line
    raise AssertionError(f"the standby server exited {server.wait()} before it was ready")


def _worker(run_dir: Path, args: list[str], **extra: str) -> subprocess.CompletedProcess:
    worker_env = {**env(), protocol.SOCKET_ENV: protocol.address(run_dir), **extra}
    return subprocess.run(
        [sys.executable, "-m", "launch.standby.worker", *args],
        cwd=REPO,
        env=worker_env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.current_stack
def test_standby_is_fork_safe_and_hands_workers_their_streams_and_exit_codes(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    server = _server(run_dir)
    try:
        assert "ready" in _wait_ready(server)
        # From outside: one thread, no network socket (no process group), no CUDA library,
        # no file of the run open.
        proc = psutil.Process(server.pid)
        assert proc.num_threads() == 1
        assert all(c.family == socket.AF_UNIX for c in proc.net_connections("all"))
        if ctypes.util.find_library("cuda") is not None:  # only where it could be loaded
            assert "libcuda.so" not in Path(f"/proc/{server.pid}/maps").read_text()
        assert not [f for f in proc.open_files() if str(run_dir) in f.path]

        # A worker it forks prints on the standby worker's own stdout and exits with its code.
        shown = _worker(run_dir, ["--help"])
        assert shown.returncode == 0 and shown.stdout.startswith("usage: python -m pretrain")
        assert "starting plainly" not in shown.stderr
        refused = _worker(run_dir, ["recipe=no_such_recipe"])
        assert refused.returncode == 2 and "unknown recipe" in refused.stderr
        reaped = (run_dir / "attempts" / "standby").glob("*.jsonl")
        codes = [line for path in reaped for line in path.read_text().splitlines()]
        assert len(codes) == 2 and '"exit_code": 2' in codes[1]

        # Loaded under another thread count: refused, and the worker starts plainly.
        plain = _worker(run_dir, ["--help"], OMP_NUM_THREADS="2")
        assert plain.returncode == 0 and "starting plainly" in plain.stderr
        assert "OMP_NUM_THREADS" in plain.stderr
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=30)
    # No standby at all: a plain start, said once.
    alone = _worker(run_dir, ["--help"])
    assert alone.returncode == 0 and "no standby server; starting plainly" in alone.stderr


@pytest.mark.slow
@pytest.mark.current_stack
def test_killed_worker_recovers_bit_exact_with_a_ledger_that_adds_up(
    tiny_overrides: list[str], tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    clean = clean_run(tiny_overrides, tmp_path_factory.getbasetemp())  # plain starts
    seed = int(os.environ.get("STANDBY_TEST_SEED", random.randrange(1 << 16)))
    print(f"kill moment and rank drawn from seed {seed}")
    rng = random.Random(seed)
    overrides = [*base_overrides(tiny_overrides, tmp_path, "standby"), "launch.standby=true"]
    run_dir = tmp_path / "standby"
    log = tmp_path / "launcher.log"
    with log.open("w") as sink:
        job = subprocess.Popen(
            launch_cmd(overrides, max_restarts=1), cwd=REPO, env=env(), stderr=sink, text=True
        )
        try:
            killed_at, first_step_seen, rank = kill_and_watch(run_dir, job, rng)
            assert job.wait(timeout=240) == 0, log.read_text()[-6000:]
        finally:
            if job.poll() is None:
                job.kill()
    text = log.read_text()
    assert "starting plainly" not in text, "a worker did not come from the standby"
    first, second = attempts(run_dir)
    assert first["first_failing_rank"] == rank and first["failure_cause"] == "killed by SIGKILL"
    assert second["status"] == "finished"
    assert losses(run_dir) == losses(clean)  # forked workers train as plain ones, bit for bit

    rto = first["rto"]
    assert rto["fault_source"] == "the worker's parent reaped it", rto
    assert 0 <= rto["fault_at_clock"] - killed_at < 0.5, (rto, killed_at)
    phases = [rto[f"{p}_s"] for p in PHASES]
    assert all(v is not None and v > 0 for v in phases), rto
    # The phases telescope to the total by construction; what can fail is the total against
    # this test's own clock: its kill -> the first step it saw.
    assert rto["total_s"] <= first_step_seen - killed_at + 0.05
    assert first_step_seen - killed_at - rto["total_s"] < 0.6, (rto, first_step_seen - killed_at)
    assert rto["work_lost"]["steps"] == first["lost_steps"]

    shown = subprocess.run(
        [sys.executable, "-m", "resiliency", "goodput", str(run_dir)],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "recovery from attempt 1's fault" in shown and "restore_read" in shown
