"""The restore's shard reader reads tensors straight into place and loads what megatron's own
reader loads, on the shards megatron writes and on ours (tests/workers/streaming_load.py)."""

from __future__ import annotations

import pytest

from tests.helpers import worker_report

pytestmark = [pytest.mark.current_stack]
CASES = [f"{w}/{p}" for w in ("megatron", "ours") for p in ("whole", "rows", "columns")]
SHARDS = ["model/__0_0.distcp", "model/__0_1.distcp"]


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("streaming-load") / "report.json"
    return worker_report("streaming_load", out)


def test_the_compat_hook_hands_megatron_our_reader(report: dict) -> None:
    assert report["reader_calls"] == len(CASES)


@pytest.mark.parametrize("case", CASES)
def test_loads_the_saved_values(report: dict, case: str) -> None:
    # Compared with the tensors that were saved, not with what either reader returns.
    assert report["equal"][case] is True


@pytest.mark.parametrize("writer", ["megatron", "ours"])
def test_contiguous_parts_are_read_into_place_and_the_rest_by_torch(
    report: dict, writer: str
) -> None:
    # 9 tensors: 3 shapes x 3 dtypes; a column half of a matrix is no contiguous run of bytes.
    assert report["stats"][f"{writer}/whole"] == [9, 0]
    assert report["stats"][f"{writer}/rows"] == [9, 0]
    assert report["stats"][f"{writer}/columns"] == [6, 3]


@pytest.mark.parametrize("case", CASES)
def test_the_read_checks_every_shard_file_it_reads_against_its_crc32c(
    report: dict, case: str
) -> None:
    # Two shard files per writer here (one rank, two writer threads): read, their gaps too,
    # and found intact, also where a column chunk leaves most bytes to torch's path.
    verdict = report["verdicts"][case]
    assert verdict == {"checked": SHARDS, "problem": None}, verdict


@pytest.mark.parametrize("where", ["end", "middle"])
def test_a_byte_changed_anywhere_in_the_file_is_found(report: dict, where: str) -> None:
    # At the end: a byte of the archive's directory, which the load never places; in the
    # middle: tensor data, placed into the model as it was read.
    verdict = report["corrupt"][where]
    assert verdict["checked"] == SHARDS, verdict
    assert verdict["problem"].startswith("file 'model/__0_0.distcp' crc32c mismatch: "), verdict
