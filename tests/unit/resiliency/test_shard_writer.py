"""Shard writes run on threads of the saving process: same files, no forks, no zip CRC pass."""

from __future__ import annotations

import pytest

from tests.helpers import worker_report

pytestmark = [pytest.mark.current_stack]


def _forking_megatron() -> bool:
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    return hasattr(FileSystemWriterAsync, "write_preloaded_data_multiproc") and not hasattr(
        FileSystemWriterAsync, "write_preloaded_data_multithread"
    )


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return worker_report("shard_writes", tmp_path_factory.mktemp("shard-writes") / "report.json")


def test_in_process_writes_load_back_equal(report: dict) -> None:
    assert report["equal"] is True
    assert report["files"] == ["__0_0.distcp", "__0_1.distcp"]  # one file per writer thread
    assert report["crc_option_after"] is True  # the caller's torch.save is left as it was


@pytest.mark.skipif(not _forking_megatron(), reason="this megatron-core writes on threads")
def test_megatron_016_forks_per_bucket_and_ours_does_not(report: dict) -> None:
    assert report["megatron_forks"] == 2  # what the replacement is for (and proves we count)
    assert report["in_process_forks"] == 0


@pytest.mark.skipif(not _forking_megatron(), reason="0.19 starts writer threads of its own")
def test_zip_crc_is_skipped_only_by_our_writers(report: dict) -> None:
    # Every torch.save record of megatron's own write carries a CRC-32, ours none: the
    # writers' crc32c already covers every byte (and restores verify it).
    assert report["zip_crcs_set"]["megatron"] > 0
    assert report["zip_crcs_set"]["threads"] == 0


def test_a_failed_write_fails_the_save(report: dict) -> None:
    error = report["missing_dir_error"]
    assert error and "CheckpointException" in error and "No such file" in error
