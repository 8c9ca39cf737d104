"""The directory-backed write-results queue (compat fix J): FIFO across forked and spawned
processes, nothing left behind by its owner, stale directories of dead owners removed."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import subprocess
import sys
from pathlib import Path

import pytest

from pretrain.platform.file_queue import PREFIX, FileQueue


def _put_from_child(results: FileQueue, item: object) -> None:
    results.put(item)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_items_from_child_processes_arrive_in_order(tmp_path: Path, method: str) -> None:
    results = FileQueue.create(tmp_path)
    ctx = mp.get_context(method)
    for item in ({"rank": 0, "bytes": 1 << 30}, ValueError("disk full")):
        child = ctx.Process(target=_put_from_child, args=(results, item))
        child.start()
        child.join()
        assert child.exitcode == 0
    first, second = results.get_nowait(), results.get(timeout=1)
    assert first == {"rank": 0, "bytes": 1 << 30}
    assert isinstance(second, ValueError) and str(second) == "disk full"
    assert results.empty()
    with pytest.raises(queue.Empty):
        results.get_nowait()
    with pytest.raises(queue.Empty):
        results.get(timeout=0.05)
    assert os.listdir(results.directory) == []


def _our_pid_namespace() -> int:
    return int(os.readlink("/proc/self/ns/pid").removeprefix("pid:[").removesuffix("]"))


def test_dead_owners_directories_are_removed(tmp_path: Path) -> None:
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    ns = _our_pid_namespace()
    stale = tmp_path / f"{PREFIX}{ns}-{dead}-abc"
    stale.mkdir()
    (stale / "left.pkl").write_bytes(b"x")
    alive = tmp_path / f"{PREFIX}{ns}-{os.getpid()}-def"
    alive.mkdir()
    # A queue of another container sharing /dev/shm: its pid means nothing here.
    foreign = tmp_path / f"{PREFIX}{ns + 1}-{dead}-ghi"
    foreign.mkdir()
    mine = FileQueue.create(tmp_path)
    assert not stale.exists()
    assert alive.exists() and foreign.exists() and mine.directory.exists()
    mine.remove()
    assert not mine.directory.exists()
