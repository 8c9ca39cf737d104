"""The restore's shard reader reads tensors straight into place and loads what megatron's own
reader loads, on the shards megatron writes and on ours (tests/workers/streaming_load.py)."""

from __future__ import annotations

import pytest

from tests.helpers import worker_report

pytestmark = [pytest.mark.current_stack]
CASES = [f"{w}/{p}" for w in ("megatron", "ours") for p in ("whole", "rows", "columns")]


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
