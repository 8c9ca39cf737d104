"""launch local's copy of its launcher's output never holds the launcher: a file that does not
take writes (a FIFO nobody reads: every write blocks, as on a hung mount) leaves ``write``
instant, and the lines arrive in order once it moves; a writer that cannot open its file
(a missing dir, a full disk) ends the keeping with one warning naming the error."""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import pytest

from launch import kept_log
from launch.kept_log import KeptLog


def test_a_file_that_blocks_never_blocks_the_writer_and_nothing_is_lost(tmp_path: Path) -> None:
    fifo = tmp_path / "launch-local.log"
    os.mkfifo(fifo)
    keep = KeptLog(fifo)
    lines = [f"line {i} " + "x" * 200 + "\n" for i in range(2000)]  # more than a pipe holds
    started = time.monotonic()
    for line in lines:
        keep.write(line)
    assert time.monotonic() - started < 2.0  # no write waited for the stuck file
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()))
    reader.start()  # the storage answers
    keep.close()
    reader.join(timeout=30)
    assert got and got[0].decode() == "".join(lines)


def test_lines_past_the_backlog_are_dropped_oldest_first_and_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kept_log, "BACKLOG_BYTES", 64 << 10)
    fifo = tmp_path / "launch-local.log"
    os.mkfifo(fifo)
    keep = KeptLog(fifo)
    lines = [f"line {i:05d} " + "x" * 1000 + "\n" for i in range(1000)]  # ~1 MiB
    for line in lines:
        keep.write(line)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()))
    reader.start()
    keep.write("the last line\n")
    keep.close()
    reader.join(timeout=30)
    text = got[0].decode()
    assert text.endswith("the last line\n")
    assert "lines not kept here: the run dir did not answer]" in text
    kept = [line for line in text.splitlines() if line.startswith("line ")]
    numbers = [int(line.split()[1]) for line in kept]
    assert numbers == sorted(numbers) and numbers[-1] == 999 and len(numbers) < 1000


def test_a_writer_that_cannot_open_its_file_says_why_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    keep = KeptLog(tmp_path / "missing" / "launch-local.log")
    keep.child.wait(timeout=30)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            keep.write("a line\n")
        keep.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "No such file or directory" in warnings[0], warnings
