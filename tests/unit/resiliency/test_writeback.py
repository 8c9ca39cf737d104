"""A checkpoint writer starts the kernel's writeback as a file grows and drops what is written
back from the page cache, seen from outside the writer process by strace; where the calls are
refused, writing goes on without them."""

from __future__ import annotations

import errno
import io
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import crc32c
import pytest

from resiliency.storage.checksum import ChecksummingStream, WriterChecksums
from resiliency.storage.writeback import CHUNK_BYTES, DROP_LAG_BYTES

MIB = 1 << 20
REPO = Path(__file__).resolve().parents[3]

# A writer as megatron's: the module's `open` is WriterChecksums.open, buffered writes of
# 3 MiB (not a multiple of the writeback chunk), then an fsync, as the shard writers do.
WRITER = """
import os, sys
from resiliency.storage.checksum import WriterChecksums
data = bytes(range(256)) * (3 << 12)  # 3 MiB
with WriterChecksums().open(sys.argv[1], "wb") as f:
    for _ in range(14):  # 42 MiB
        f.write(data)
    f.flush()
    os.fsync(f.fileno())
"""


def _strace_works() -> bool:
    """strace installed and allowed to trace (containers may deny ptrace)."""
    if shutil.which("strace") is None:
        return False
    probe = subprocess.run(["strace", "-f", "-o", "/dev/null", "true"], capture_output=True)
    return probe.returncode == 0


@pytest.mark.skipif(not _strace_works(), reason="needs strace, allowed to trace")
def test_writer_starts_writeback_every_16_mib_and_drops_what_is_behind(tmp_path):
    path = tmp_path / "shard.distcp"
    trace = tmp_path / "trace"
    subprocess.run(
        ["strace", "-f", "-o", str(trace), "-e", "trace=sync_file_range,fadvise64,fsync,write",
         sys.executable, "-c", WRITER, str(path)],
        cwd=REPO,
        check=True,
        timeout=120,
    )  # fmt: skip
    calls = [line.split(None, 1)[1] for line in trace.read_text().splitlines() if "(" in line]
    # What the writer did to the shard, in order: W a 3 MiB write, S a writeback start of the
    # whole file without waiting (SYNC_FILE_RANGE_WRITE only), D its first 4 MiB advised out
    # of the page cache, F an fsync.
    events = "".join(
        "W" if c.startswith("write(") and c.endswith(f"= {3 * MIB}")
        else "S" if re.match(r"sync_file_range\(\d+, 0, 0, SYNC_FILE_RANGE_WRITE\)", c)
        else "D" if re.match(rf"fadvise64\(\d+, 0, {4 * MIB}, POSIX_FADV_DONTNEED\) = 0", c)
        else "F" if c.startswith("fsync(")
        else "?" if c.startswith("fadvise64(")
        else ""
        for c in calls
    )  # fmt: skip
    # 42 MiB in 3 MiB writes: started after 18 and 36 MiB (the first writes past each 16 MiB
    # since the last start); at 36 MiB what lies 32 MiB behind, the first 4, is dropped (at
    # 18 nothing is that far behind); the fsync, last, is what makes it durable.
    assert (CHUNK_BYTES, DROP_LAG_BYTES) == (16 * MIB, 32 * MIB)
    assert events == "W" * 6 + "S" + "W" * 6 + "S" + "D" + "W" * 2 + "F"
    data = bytes(range(256)) * (3 << 12)
    assert path.read_bytes() == data * 14


def test_streams_the_call_cannot_serve_are_written_without_it(tmp_path):
    data = bytes(range(256)) * (1 << 14)  # 4 MiB
    for raw in (io.BytesIO(), open("/dev/null", "wb")):  # no fd; an fd the call refuses
        with raw:
            stream = ChecksummingStream(raw)
            for _ in range(10):
                assert stream.write(data) == len(data)
            assert stream.nbytes == 40 * MIB
            assert stream.checksum == f"{crc32c.crc32c(data * 10):08x}"
    sums = WriterChecksums()
    with sums.open(tmp_path / "small", "wb") as f:  # under one chunk: no call at all
        f.write(b"x" * MIB)
    assert (tmp_path / "small").stat().st_size == MIB


def _write_64_mib(path: Path, drop_behind: bool = True) -> None:
    data = bytes(range(256)) * (1 << 14)  # 4 MiB
    with open(path, "wb") as raw:
        stream = ChecksummingStream(raw, drop_behind=drop_behind)
        for _ in range(16):
            assert stream.write(data) == len(data)
    assert path.read_bytes() == data * 16
    assert stream.checksum == f"{crc32c.crc32c(data * 16):08x}"


def test_a_file_that_refuses_the_advice_is_written_without_it(tmp_path, monkeypatch, caplog):
    calls = []

    def refuse(fd, offset, length, advice):
        calls.append((offset, length))
        raise OSError(errno.EBADF, "Bad file descriptor")

    monkeypatch.setattr(os, "posix_fadvise", refuse)
    with caplog.at_level(logging.WARNING, logger="resiliency.storage.writeback"):
        _write_64_mib(tmp_path / "shard")
    # Advised at 48 MiB (its first 16, behind the lag), refused, not asked again at 64; an
    # unexpected refusal is said once, as a warning.
    assert calls == [(0, 16 * MIB)]
    assert [r.levelno for r in caplog.records] == [logging.WARNING]


def test_the_node_local_tier_keeps_its_pages(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(os, "posix_fadvise", lambda *args: calls.append(args))
    _write_64_mib(tmp_path / "kept", drop_behind=False)
    assert calls == []
    _write_64_mib(tmp_path / "dropped")  # each advice from the file's start, up to the lag
    assert [(offset, length) for _, offset, length, _ in calls] == [(0, 16 * MIB), (0, 32 * MIB)]
