"""io_wait names the file a thread is blocked on, from /proc, for threads this test blocks on
purpose: a read of a pipe (an fd-based syscall) and an open of a FIFO no one writes to (a
path-based one, its argument read from the process's memory)."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import pytest

from resiliency.monitor.io_wait import blocked_in

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")


def _blocked(target, *args) -> tuple[threading.Thread, int]:  # noqa: ANN001
    ready: list[int] = []

    def run() -> None:
        ready.append(threading.get_native_id())
        target(*args)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    while not ready:
        time.sleep(0.01)
    time.sleep(0.2)  # into the syscall
    return thread, ready[0]


def test_a_thread_blocked_reading_is_named_with_its_file() -> None:
    read_end, write_end = os.pipe()
    thread, tid = _blocked(os.read, read_end, 1)
    seen = blocked_in(os.getpid(), tid)
    os.write(write_end, b"x")
    thread.join(timeout=5)
    assert seen is not None and seen["syscall"] == "read", seen
    assert seen["path"] == os.readlink(f"/proc/self/fd/{read_end}")  # pipe:[inode]
    assert blocked_in(os.getpid(), tid) is None  # the thread is gone


def test_a_thread_blocked_opening_a_path_is_named_with_the_path(tmp_path: Path) -> None:
    fifo = tmp_path / "a fifo nobody writes"
    os.mkfifo(fifo)
    thread, tid = _blocked(os.open, str(fifo), os.O_RDONLY)
    seen = blocked_in(os.getpid(), tid)
    fd = os.open(fifo, os.O_WRONLY)  # lets the opener through
    thread.join(timeout=5)
    os.close(fd)
    assert seen == {"syscall": "openat", "path": str(fifo)} or seen == {
        "syscall": "open",
        "path": str(fifo),
    }, seen


def test_a_running_or_idle_thread_is_not_blocked_on_a_file() -> None:
    assert blocked_in(os.getpid(), threading.get_native_id()) is None  # running: this one
    assert blocked_in(os.getpid(), 1 << 30) is None  # no such thread


def test_the_heartbeat_names_a_worker_threads_wait_on_a_file_not_an_idle_pipe_reader(
    tmp_path: Path,
) -> None:
    """A save's writer thread stuck in a call on a file (here: opening a FIFO) is the rank's
    wait once it lasted a beat; a helper thread idle on a pipe is no wait on the storage."""
    from resiliency.monitor.stacks import BEAT_S, _file_calls, _longest_wait

    read_end, write_end = os.pipe()
    idle, _ = _blocked(os.read, read_end, 1)
    fifo = tmp_path / "shard"
    os.mkfifo(fifo)
    writer, tid = _blocked(os.open, str(fifo), os.O_RDONLY)
    main = threading.main_thread().native_id or 0
    now = time.time()
    first = _file_calls(os.getpid(), main, {}, now)
    later = _file_calls(os.getpid(), main, first, now + 2 * BEAT_S)
    fd = os.open(fifo, os.O_WRONLY)
    os.write(write_end, b"x")
    writer.join(timeout=5)
    idle.join(timeout=5)
    os.close(fd)
    assert set(first) == {tid}, first  # the pipe reader is not listed
    assert _longest_wait(first, main, now) is None  # not a beat long yet
    assert later[tid]["since"] == first[tid]["since"]  # the same call: since kept
    assert _longest_wait(later, main, now + 2 * BEAT_S)["path"] == str(fifo)
