"""A rank whose peer is SIGKILLed (from outside) while megatron-core waits on an async
collective's handle is a victim of that peer, not a failing rank of its own: the post-mortem
must name the killed rank (CI once named the survivor, whose failure file said
"infrastructure", because the wait's Python frame is megatron's, not torch.distributed's)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import REPO

pytestmark = [pytest.mark.current_stack]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("lost-peer")
    out, port = root / "report.json", _free_port()
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
    deadline = time.monotonic() + 120
    while not Path(f"{out}.waiting").exists():
        assert time.monotonic() < deadline and procs[1].poll() is None, procs[1].stderr.read()
        time.sleep(0.1)
    os.kill(procs[0].pid, signal.SIGKILL)
    procs[0].wait(timeout=30)
    _, err = procs[1].communicate(timeout=120)
    assert procs[1].returncode == 0, err[-4000:]
    return json.loads(out.read_text())


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
