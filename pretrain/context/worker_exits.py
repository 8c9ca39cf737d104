"""How each worker ended, as its parent saw it: the one owner of
``<run_dir>/attempts/standby/<host>.jsonl``.

A worker's parent (the standby server that forked it, or the worker entrypoint that started it
as a child when the job has spare nodes) appends one line per worker it reaps: the worker's pid,
its signal or exit code, the host clock and the wall time then, and the host's identity. The
post-mortem takes these as first-hand evidence of which rank died first and when (the launcher
sees only its direct child, the entrypoint). Torch-free and quick to import.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from pretrain.context.run_dir import RunDir, read_jsonl
from pretrain.context.startup_clock import host_clock, host_identity


def record_exit(run_dir: Path, pid: int, status: int) -> dict[str, Any]:
    """Append how worker ``pid`` ended (its wait ``status``); returns the line written."""
    body: dict[str, Any] = {"pid": pid, "clock": host_clock(), "wall": time.time()}
    if os.WIFSIGNALED(status):
        body["signal"] = os.WTERMSIG(status)
    else:
        body["exit_code"] = os.waitstatus_to_exitcode(status)
    body.update(host_identity())
    path = RunDir(run_dir).standby_exits_dir / f"{socket.gethostname()}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as out:
        out.write(json.dumps(body) + "\n")
    return body


def worker_exits(
    run_dir: Path, workers: set[tuple[str, int]], window: tuple[float, float]
) -> list[dict]:
    """The recorded ends of ``workers`` ((host, pid): pids repeat across nodes) in the wall
    ``window``, first first (by wall time: each host has its own clock)."""
    exits = [
        e
        for path in RunDir(run_dir).standby_exits_dir.glob("*.jsonl")
        for e in read_jsonl(path)
        if (e.get("host"), e.get("pid")) in workers
        and window[0] <= e.get("wall", -1.0) <= window[1]
    ]
    return sorted(exits, key=lambda e: e["wall"])
