"""A checkpoint writer starts the kernel's writeback as a file grows, seen from outside the
writer process by strace; where the call is refused, writing goes on without it."""

from __future__ import annotations

import io
import re
import shutil
import subprocess
import sys
from pathlib import Path

import crc32c
import pytest

from resiliency.storage.checksum import ChecksummingStream, WriterChecksums

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


@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace")
def test_writer_starts_writeback_every_16_mib_before_its_fsync(tmp_path):
    path = tmp_path / "shard.distcp"
    trace = tmp_path / "trace"
    subprocess.run(
        ["strace", "-f", "-o", str(trace), "-e", "trace=sync_file_range,fsync",
         sys.executable, "-c", WRITER, str(path)],
        cwd=REPO,
        check=True,
        timeout=120,
    )  # fmt: skip
    calls = [line.split(None, 1)[1] for line in trace.read_text().splitlines() if "(" in line]
    starts = [
        (int(m.group(1)), m.group(2))
        for c in calls
        if (m := re.match(r"sync_file_range\(\d+, (\d+), 0, (\w+)\)", c))
    ]
    fsyncs = [i for i, c in enumerate(calls) if c.startswith("fsync(")]
    # 42 MiB in 3 MiB writes: writeback started after 18 and 36 MiB, each from where the
    # last one left off, without waiting (SYNC_FILE_RANGE_WRITE only).
    assert starts == [(0, "SYNC_FILE_RANGE_WRITE"), (18 * MIB, "SYNC_FILE_RANGE_WRITE")]
    assert len(fsyncs) == 1 and fsyncs[0] == len(calls) - 1  # durability: the fsync, last
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
