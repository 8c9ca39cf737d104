"""Checksums computed inside checkpoint writers equal a read-back checksum of the file."""

from __future__ import annotations

import os

from resiliency.storage.checksum import WriterChecksums, describe_written, file_checksum


def test_forked_writer_reports_the_checksum_of_what_it_wrote(tmp_path):
    sums = WriterChecksums()
    path = tmp_path / "shard.distcp"
    pid = os.fork()
    if pid == 0:  # a writer process, as megatron forks them
        with sums.open(path, "wb") as f:
            f.write(b"abc" * 1000)
            f.write(memoryview(bytearray(range(256)) * 100))
            assert f.tell() == 3000 + 25600
            os.fsync(f.fileno())
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    reports = sums.drain()
    size, checksum = reports[str(path)]
    assert size == path.stat().st_size and checksum == file_checksum(path)
    entry = describe_written(tmp_path, "shard.distcp", size, checksum)
    assert (entry.bytes, entry.checksum) == (size, checksum)


def test_unverifiable_writes_report_nothing(tmp_path):
    sums = WriterChecksums()
    with sums.open(tmp_path / "a", "wb") as f:
        f.write(b"xx")
        f.seek(0)
    try:
        with sums.open(tmp_path / "b", "wb") as f:
            f.write(b"yy")
            raise RuntimeError("writer failed")
    except RuntimeError:
        pass
    with sums.open(tmp_path / "c", "w") as f:  # text mode: not a shard, not wrapped
        f.write("zz")
    assert sums.drain() == {}


def test_size_mismatch_falls_back_to_reading_the_file(tmp_path):
    (tmp_path / "f").write_bytes(b"12345")
    entry = describe_written(tmp_path, "f", 3, "00000000")
    assert entry.bytes == 5 and entry.checksum == file_checksum(tmp_path / "f")
