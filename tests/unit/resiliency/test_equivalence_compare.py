"""The equivalence gate's judge on dumps written by hand: what it calls equal and different is
decided here, from tensors and values this test builds, not by the code that dumps them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from resiliency.checkpoint.equivalence import state_dump
from resiliency.checkpoint.equivalence.compare import DumpError, compare_runs

LAYOUT = {"world": 2, "dp": 2, "tp": 1, "pp": 1, "ep": 1, "cp": 1, "vpp": None}


def _dump(rank: int, step: int, world: int, tensors: dict, ranges: dict, grads_of=None) -> dict:
    layout = {**LAYOUT, "world": world, "dp": world, "rank": rank}
    layout.update(model_rank=[0, 0], dp_rank=rank)
    values = {"loop/step": step, "loop/lr": 0.001, "data/next_batch": [10 + rank, 20 + rank]}
    return {
        "format": 1,
        "layout": layout,
        "step": step,
        "grads_of": grads_of,
        "tensors": tensors,
        "values": values,
        "ranges": ranges,
    }


def _write(root: Path, dumps: list[dict]) -> Path:
    for dump in dumps:
        state_dump.write(dump, state_dump.dump_path(root, dump["step"], dump["layout"]["rank"]))
    return root


WEIGHT = torch.arange(8, dtype=torch.float32) / 7
MOMENT = torch.linspace(0.5, 1.5, 8)


def _dp2(root: Path, weight=WEIGHT, moment=MOMENT, step=2, grads_of=None) -> Path:
    dumps = []
    for rank, (start, end) in enumerate([(0, 5), (5, 8)]):
        tensors = {
            "model/w": weight.clone(),
            "optimizer/w/exp_avg": moment[start:end].clone(),
            "optimizer/w/step": torch.tensor([2.0]),
            "rng/torch": torch.tensor([1, 2, 3], dtype=torch.uint8),
        }
        dumps.append(_dump(rank, step, 2, tensors, {"w": [start, end, 8]}, grads_of))
    return _write(root, dumps)


def test_the_same_state_is_equal(tmp_path: Path) -> None:
    verdict = compare_runs(_dp2(tmp_path / "a"), _dp2(tmp_path / "b"))
    assert verdict.equivalent and verdict.mode == "same layout"
    assert verdict.compared == 2 * (3 + 4)  # values and tensors of both ranks


def test_one_bit_of_one_element_is_named(tmp_path: Path) -> None:
    moment = MOMENT.clone()
    moment.view(torch.int32)[6] ^= 1  # the lowest mantissa bit, in rank 1's range
    verdict = compare_runs(_dp2(tmp_path / "a"), _dp2(tmp_path / "b", moment=moment))
    assert [str(d) for d in verdict.differences] == [
        f"step 2, rank 1: optimizer/w/exp_avg: 1 of 3 elements differ, first at [1]: "
        f"{MOMENT[6].item()!r} (reference) vs {moment[6].item()!r} (resumed)"
    ]


def test_minus_zero_and_nan_payloads_are_not_equal_to_their_lookalikes(tmp_path: Path) -> None:
    weight = WEIGHT.clone()
    weight[0] = -0.0  # == 0.0 as a number, not as bytes
    assert not compare_runs(_dp2(tmp_path / "a"), _dp2(tmp_path / "b", weight=weight)).equivalent


def test_the_first_difference_is_the_first_kind_a_restore_puts_back(tmp_path: Path) -> None:
    ref = _dp2(tmp_path / "a")
    res = _dp2(tmp_path / "b", weight=WEIGHT + 1)
    dump = state_dump.read(state_dump.dump_path(res, 2, 0))
    dump["values"]["loop/lr"] = 0.002
    state_dump.write(dump, state_dump.dump_path(res, 2, 0))
    names = [d.name for d in compare_runs(ref, res).differences]
    assert names == ["loop/lr", "model/w", "model/w"]


def test_gradients_are_compared_only_where_both_runs_trained_the_step(tmp_path: Path) -> None:
    ref = _dp2(tmp_path / "a", grads_of=2)
    for rank in (0, 1):
        dump = state_dump.read(state_dump.dump_path(ref, 2, rank))
        dump["tensors"]["grad/w"] = torch.ones(3)
        state_dump.write(dump, state_dump.dump_path(ref, 2, rank))
    verdict = compare_runs(ref, _dp2(tmp_path / "b"))  # restored at step 2: no gradients
    assert verdict.equivalent
    assert any("gradients" in item for item in verdict.not_compared)


def _dp1(root: Path, weight=WEIGHT, moment=MOMENT, step=2, grads_of=None) -> Path:
    tensors = {
        "model/w": weight.clone(),
        "optimizer/w/exp_avg": moment.clone(),
        "optimizer/w/step": torch.tensor([2.0]),
        "rng/torch": torch.tensor([9], dtype=torch.uint8),  # reseeded: another stream
    }
    dump = _dump(0, step, 1, tensors, {"w": [0, 8, 8]}, grads_of)
    dump["values"]["data/next_batch"] = [21, 10, 20, 11]  # the same samples, one rank
    return _write(root, [dump])


def test_a_data_parallel_change_compares_whole_tensors(tmp_path: Path) -> None:
    verdict = compare_runs(_dp2(tmp_path / "a"), _dp1(tmp_path / "b"))
    assert verdict.equivalent and verdict.mode == "data-parallel change"
    assert any("RNG" in item for item in verdict.not_compared)
    moment = MOMENT.clone()
    moment[0] += 1e-6  # rank 0's range of the reference
    verdict = compare_runs(_dp2(tmp_path / "c"), _dp1(tmp_path / "d", moment=moment))
    assert [d.name for d in verdict.differences] == ["optimizer/w/exp_avg"]


def test_after_the_first_resumed_step_a_dp_change_is_held_to_rtol(tmp_path: Path) -> None:
    ref = _dp2(tmp_path / "a", step=3, grads_of=3)
    close = _dp1(tmp_path / "b", weight=WEIGHT * (1 + 1e-7), step=3, grads_of=3)
    assert compare_runs(ref, close, rtol=1e-5).equivalent
    far = _dp1(tmp_path / "c", weight=WEIGHT * (1 + 1e-3), step=3, grads_of=3)
    assert [d.name for d in compare_runs(ref, far, rtol=1e-5).differences] == ["model/w"]


def test_a_range_no_rank_holds_is_a_difference(tmp_path: Path) -> None:
    ref = _dp2(tmp_path / "a")
    dump = state_dump.read(state_dump.dump_path(ref, 2, 1))
    dump["tensors"]["optimizer/w/exp_avg"] = MOMENT[6:8].clone()
    dump["ranges"]["w"] = [6, 8, 8]
    state_dump.write(dump, state_dump.dump_path(ref, 2, 1))
    details = [d.detail for d in compare_runs(ref, _dp1(tmp_path / "b")).differences]
    assert "1 of 8 elements held by no rank" in details


def test_dumps_that_cannot_be_compared_are_refused(tmp_path: Path) -> None:
    with pytest.raises(DumpError, match="no state dumps"):
        compare_runs(tmp_path / "none", _dp2(tmp_path / "b"))
    tp2 = _dp2(tmp_path / "c")
    for rank in (0, 1):
        dump = state_dump.read(state_dump.dump_path(tp2, 2, rank))
        dump["layout"]["tp"] = 2
        state_dump.write(dump, state_dump.dump_path(tp2, 2, rank))
    with pytest.raises(DumpError, match="model parallelism"):
        compare_runs(_dp2(tmp_path / "a"), tp2)
