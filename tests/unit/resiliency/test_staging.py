"""Staging buffers: the fast fully-reshardable optimizer state is megatron's, value for value."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.helpers import REPO, TORCHRUN

pytestmark = [pytest.mark.current_stack]
WORKER = str(REPO / "tests" / "workers" / "staged_state.py")
LLAMA_STYLE = [
    "model.normalization=RMSNorm",
    "model.activation=swiglu",
    "model.add_bias_linear=false",
    "model.num_query_groups=2",
    "model.share_embeddings_and_output_weights=false",
]


def _compare(overrides: list[str], tmp_path: Path) -> list[dict]:
    out = tmp_path / "report.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            TORCHRUN,
            "--standalone",
            "--nproc-per-node=2",
            WORKER,
            f"--out={out}",
            *overrides,
            f"output_dir={tmp_path}",
            "run_id=staged",
        ],
        cwd=REPO,
        env=env,
        text=True,
        capture_output=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize(
    "layout,in_place",
    [
        (["parallel.tp=2"], True),  # DP=1: one copy per param
        (["parallel.tp=1"], False),  # DP=2: gathered over the gloo DP group
        (["recipe=gpt_tiny_moe", "parallel.ep=2"], True),  # chained optimizers (dense + expert)
        # SwiGLU's fc1 is a sharded-tensor factory (gate and up), with no offsets of its own:
        # every Llama-style save once failed on it.
        (["parallel.tp=2", *LLAMA_STYLE], True),
    ],
    ids=["tp2", "dp2", "moe-ep2", "llama-tp2"],
)
def test_staged_optimizer_state_equals_megatrons(
    layout: list[str], in_place: bool, tiny_overrides: list[str], tmp_path: Path
) -> None:
    reports = _compare([*tiny_overrides, *layout], tmp_path)
    for rank, report in enumerate(reports):
        assert report["mismatches"] == [], (rank, report["mismatches"][:5])
        assert report["compared"] > 0
        # Every optimizer tensor came from the fast path (a silent fallback would also match).
        assert report["fast_tensors"] == report["compared"] - report["non_tensors"], report
        # Sync saves write Adam's moments of a DP=1 optimizer in place, still equal to
        # megatron's; gathered (DP>1) state is always copied.
        assert report["in_place_mismatches"] == [], (rank, report["in_place_mismatches"][:5])
        assert (report["in_place"] > 0) == in_place, report
        # fp32 main params are the model params (DP=1): one staged copy serves both records.
        assert (report["shared_with_model"] > 0) == in_place, report
        # Buffers reserved from a dry run (meta tensors, no collectives) are exactly the ones
        # the first async save stages into: it allocates none, and its state is megatron's.
        assert report["reserve_misses"] == [], (rank, report["reserve_misses"][:5])
        assert report["reserved_mismatches"] == [], (rank, report["reserved_mismatches"][:5])


def test_async_staging_uses_shared_memory_only_when_dev_shm_holds_it(caplog) -> None:
    from resiliency.checkpoint.write.staging import shm_free_bytes, staging_for

    assert staging_for(True, param_bytes=1 << 20, ranks_on_node=2).shared
    assert not staging_for(False, param_bytes=1 << 20, ranks_on_node=2).shared
    too_big = shm_free_bytes()  # x4 state bytes per param byte x 2 ranks: cannot fit
    with caplog.at_level("WARNING"):
        assert not staging_for(True, param_bytes=too_big, ranks_on_node=2).shared
    assert "Give /dev/shm more room" in caplog.text


def test_staging_buffers_are_reused_per_key_and_replaced_on_shape_change() -> None:
    import torch

    from resiliency.checkpoint.write.staging import StagingBuffers

    staging = StagingBuffers(shared=True)
    first = staging.stage("a", torch.arange(6.0))
    again = staging.stage("a", torch.arange(6.0) * 2)
    assert again is first and torch.equal(first, torch.arange(6.0) * 2)
    assert first.is_shared() and staging.owns(first)
    bigger = staging.stage("a", torch.ones(8))
    assert bigger is not first and not staging.owns(first) and staging.nbytes == 8 * 4
