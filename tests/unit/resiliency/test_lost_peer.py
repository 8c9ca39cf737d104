"""A rank whose peer is SIGKILLed (from outside) while megatron-core waits on an async
collective's handle is a victim of that peer, not a failing rank of its own: the post-mortem
must name the killed rank (CI once named the survivor, whose failure file said
"infrastructure", because the wait's Python frame is megatron's, not torch.distributed's)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pretrain.platform.host import free_port
from resiliency.monitor.stacks import waits_on_peers
from tests.helpers import REPO

pytestmark = [pytest.mark.current_stack]


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("lost-peer")
    out, port = root / "report.json", free_port()
    worker = str(REPO / "tests" / "workers" / "lost_peer.py")
    procs = [
        subprocess.Popen(
            [sys.executable, worker, str(rank), str(port), str(out), str(root / "stacks")],
            cwd=REPO,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    try:
        deadline = time.monotonic() + 120
        while not Path(f"{out}.waiting").exists():
            if time.monotonic() > deadline or procs[1].poll() is not None:
                _kill(procs)
                pytest.fail(f"rank 1 never waited on rank 0:\n{procs[1].stderr.read()[-4000:]}")
            time.sleep(0.1)
        os.kill(procs[0].pid, signal.SIGKILL)
        procs[0].wait(timeout=30)
        _, err = procs[1].communicate(timeout=120)
    finally:
        _kill(procs)
    assert procs[1].returncode == 0, err[-4000:]
    return json.loads(out.read_text())


def _kill(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_wait_is_megatrons_and_the_error_the_transports(report: dict) -> None:
    # The premise: the survivor fails in megatron's frame, on gloo's word that the peer left.
    assert "megatron/core/" in report["innermost"], report
    assert "gloo" in report["message"] and "peer" in report["message"], report


def test_the_survivor_records_a_lost_peer(report: dict) -> None:
    assert report["lost"] == [True, "lost peer"], report


def test_a_hang_there_dumps_as_waiting_on_peers(report: dict) -> None:
    assert report["dump"]["dumped"] and report["dump"]["in_collective"], report["dump"]


def test_a_connection_error_outside_any_collective_is_the_ranks_own(report: dict) -> None:
    assert report["plain"] == [False, "infrastructure"], report


def _megatron_line(module: str, text: str) -> tuple[str, int]:
    """(file, line) of the first line of installed megatron-core's ``module`` holding
    ``text``: the frame a rank blocked there would show."""
    import megatron.core

    path = Path(megatron.core.__file__).parent / module
    lines = path.read_text().splitlines()
    return str(path), next(i for i, line in enumerate(lines, 1) if text in line)


def test_megatrons_wait_on_a_handle_is_a_collective_wherever_the_error_says_nothing() -> None:
    wait = _megatron_line("tensor_parallel/layers.py", "handle.wait()")
    other = _megatron_line("tensor_parallel/layers.py", "grad_output.sum(dim=0)")
    assert waits_on_peers([wait, (__file__, 1)])  # innermost: megatron's handle.wait()
    assert not waits_on_peers([other, (__file__, 1)])  # megatron, but not a wait
    assert not waits_on_peers([(__file__, 1), wait])  # the wait is not the innermost frame
    assert not waits_on_peers([])
