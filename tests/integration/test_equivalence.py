"""The resume-equivalence gate through its command line (docs/checkpoints.md, "Proving a
resume exact"): on TP2, PP2, EP2 (the MoE recipe) and a DP change, a run killed and resumed in
fresh processes holds, byte for byte, the state an uninterrupted run held; a restore broken on
purpose (an RNG stream, the expert-parallel one, Adam's step counter, one rank's data cursor,
one ulp of one parameter) is caught, each break by the name of the state it broke. And the probe
reads the real state: the reference's dump at the saved step equals that step's checkpoint as
torch's own DCP reader gives it.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.helpers import REPO

pytestmark = pytest.mark.slow

K = 2  # the step saved, killed after, restored
CASES = {
    "tp2": (["parallel.tp=2"], []),
    "pp2": (["parallel.tp=1", "parallel.pp=2"], []),
    "ep2-moe": (["recipe=gpt_tiny_moe"], ["--controls"]),
    "dp2-to-dp1": (
        ["parallel.tp=1", "checkpoint.optim_format=fully_reshardable"],
        ["--controls", "--resume-nproc", "1"],
    ),
}
# What each control breaks, on which rank of the resumed run, and the state key that names it
# (written here from docs/checkpoints.md, "Proving a resume exact", not read from the gate).
CONTROLS = {
    "rng_python": (0, "rng/python"),
    "rng_numpy": ("last", "rng/numpy"),
    "rng_torch": (0, "rng/torch"),
    "rng_expert_parallel": ("last", "rng/tracker/expert-parallel-rng"),
    "adam_step": (0, r"optimizer/\S+/step"),
    "data_cursor": ("last", "loop/consumed_samples"),
    "param": ("last", r"model/\S+"),
}


def _gate(tiny: list[str], out: Path, case: str) -> subprocess.CompletedProcess[str]:
    overrides, options = CASES[case]
    base = [o for o in tiny if not o.startswith("train.train_steps")]
    if any(o.startswith("recipe=") for o in overrides):
        base = [o for o in base if not o.startswith("recipe=")]
    return subprocess.run(
        [sys.executable, "-m", "drill.equivalence", "--out", str(out), *options, *base, *overrides],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.parametrize(
    "case",
    [pytest.param(c, marks=[pytest.mark.current_stack] * (c == "ep2-moe")) for c in CASES],
)
def test_a_resumed_run_holds_the_uninterrupted_runs_state(
    tiny_overrides: list[str], tmp_path: Path, case: str
) -> None:
    proc = _gate(tiny_overrides, tmp_path / "gate", case)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "EQUAL: the resumed run holds the reference's state" in proc.stdout, proc.stdout
    assert f"steps [{K}, {K + 1}]" in proc.stdout
    dp_change = "--resume-nproc" in CASES[case][1]
    if "--controls" not in CASES[case][1]:
        return
    last = 0 if dp_change else 1
    for name, (rank, key) in CONTROLS.items():
        line = next(line for line in proc.stdout.splitlines() if f"control {name}:" in line)
        if dp_change and name.startswith("rng"):
            assert "not run (a restore on another data-parallel size reseeds" in line
            continue
        where = "rank" if not dp_change or name != "adam_step" else "tp,pp rank"
        rank = last if rank == "last" else rank
        rank_text = f"{rank}" if where == "rank" else "0,0"
        assert re.search(rf"caught \(step {K}, {where} {rank_text}: {key}: ", line), line
    if dp_change:
        _probe_reads_the_saved_state(tmp_path / "gate")


def _probe_reads_the_saved_state(out: Path) -> None:
    """The reference's dump before step K+1, its per-rank ranges put together by this test,
    equals step K's checkpoint (fully_reshardable, TP=PP=1) read by torch DCP."""
    step_dir = next((out / "runs" / "equivalence" / "steps").glob(f"step-*{K}"))
    dcp_to_torch_save(step_dir / "model", out / "saved.pt")
    saved = torch.load(out / "saved.pt", weights_only=False)
    dumps = [
        torch.load(p, weights_only=False)
        for p in sorted(out.glob(f"dumps/reference/step-{K}/*.pt"))
    ]
    assert len(dumps) == 2
    checked = 0
    for key, value in dumps[0]["tensors"].items():
        if not key.startswith("model/model."):
            continue
        name = key.removeprefix("model/model.")
        for moment in ("", "optimizer.state.exp_avg.", "optimizer.state.exp_avg_sq."):
            expected = _saved(saved, moment + name)
            if moment:
                value = _whole(dumps, name, moment.split(".")[2]).view(expected.shape)
            assert torch.equal(value, expected), (moment, name)
            checked += 1
    assert checked >= 3 * 20, checked


# The local spec's layer norms are saved under Transformer Engine's names (fused into the next
# linear), so checkpoints load either way.
TE_NAMES = {
    "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
    "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
}


def _saved(saved: dict, name: str) -> torch.Tensor:
    """A parameter of the checkpoint; megatron stacks the layers' tensors on a first dim."""
    for local, te in TE_NAMES.items():
        name = name.replace(local, te)
    layer = re.match(r"(.*decoder\.layers\.)(\d+)\.(.*)", name)
    if layer is None:
        return saved[name]
    return saved[layer.group(1) + layer.group(3)][int(layer.group(2))]


def _whole(dumps: list[dict], name: str, state: str) -> torch.Tensor:
    key = f"model.{name}"
    numel = next(d["ranges"][key][2] for d in dumps if key in d["ranges"])
    whole = torch.full((numel,), float("nan"))
    for dump in dumps:
        if key in dump["ranges"]:
            start, end, _ = dump["ranges"][key]
            whole[start:end] = dump["tensors"][f"optimizer/{key}/{state}"]
    return whole
