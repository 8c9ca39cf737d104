"""Warm start (checkpoint.init_from / init_load) through the public CLI: a run with no step of
its own starts from another run's step at another layout, as its own step 0.

Run A trains at TP=2 and saves steps 2 and 4. Runs warm-started from it train one step at
TP=1 x DP=2 with an LR of 1e-30 (an update far below a float32 ulp of any weight), so the
weights they save at step 1 are the ones they loaded: compared with A's step 4, gathered
layout-free from the files (torch DCP), not through the code under test. A's step 2 differs
from them, which shows the comparison can fail. With weights+optimizer the Adam moments are
checked by their own arithmetic: loaded, both runs take the same gradient g, so
exp_avg(weights+optimizer) - exp_avg(weights) = beta1 * exp_avg(A) (and beta2 for exp_avg_sq).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from bench.s3_server import S3Server
from pretrain.context import exit_codes
from resiliency.storage.layout import RunLayout
from resiliency.storage.object_store import ObjectStore
from resiliency.storage.remote import upload_run
from tests.helpers import REPO, run_pretrain

pytestmark = pytest.mark.slow
BETA1, BETA2 = 0.9, 0.95  # set explicitly below: the expected values are not the recipe's
FROZEN = [
    "train.train_steps=1",
    "optimizer.lr=1e-30",
    "optimizer.min_lr=0.0",
    "optimizer.weight_decay=0.0",
    "parallel.tp=1",
    f"optimizer.adam_beta1={BETA1}",
    f"optimizer.adam_beta2={BETA2}",
]


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory, tiny_overrides: list[str]) -> Path:
    root = tmp_path_factory.mktemp("warm")
    run_pretrain(2, [*tiny_overrides, f"output_dir={root}", "run_id=A", "parallel.tp=2",
                     "train.train_steps=4", "checkpoint.save_interval=2",
                     f"optimizer.adam_beta1={BETA1}", f"optimizer.adam_beta2={BETA2}"])  # fmt: skip
    return root


def _warm(tiny: list[str], root: Path, run_id: str, *extra: str, env: dict | None = None):
    return run_pretrain(
        2, [*tiny, f"output_dir={root}", f"run_id={run_id}", *FROZEN, *extra], env=env
    )


def _state(step_dir: Path, tmp: Path) -> dict[str, torch.Tensor]:
    out = tmp / f"{step_dir.parent.parent.name}-{step_dir.name}.pt"
    dcp_to_torch_save(step_dir / "model", out)
    state = torch.load(out, weights_only=False)
    return {k: v for k, v in state.items() if torch.is_tensor(v) and "_extra_state" not in k}


def _weights(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.float() for k, v in state.items() if not k.startswith("optimizer.")}


def _worst(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _step(root: Path, run_id: str, step: int) -> Path:
    return RunLayout(root, run_id).step_dir(step)


@pytest.mark.current_stack  # megatron-core 0.19 pairs optimizer groups differently
def test_weights_and_moments_of_another_run_at_another_layout(
    source: Path, tiny_overrides: list[str], tmp_path: Path
) -> None:
    a4 = _step(source, "A", 4)
    _warm(tiny_overrides, source, "W", f"checkpoint.init_from={source / 'A'}")
    proc = _warm(tiny_overrides, source, "WO", f"checkpoint.init_from={a4}",
                 "checkpoint.init_load=weights+optimizer")  # fmt: skip
    assert "WARNING" not in proc.stderr, proc.stderr[-3000:]  # a layout change is the point

    a, w, wo = (_state(d, tmp_path) for d in (a4, _step(source, "W", 1), _step(source, "WO", 1)))
    assert _worst(_weights(w), _weights(a)) < 1e-12  # the run dir's newest step, resharded
    assert _worst(_weights(wo), _weights(a)) < 1e-12
    assert _worst(_weights(_state(_step(source, "A", 2), tmp_path)), _weights(a)) > 1e-4
    for moment, beta in (("exp_avg", BETA1), ("exp_avg_sq", BETA2)):
        keys = [k for k in a if f".{moment}." in k]
        assert keys, sorted(a)[:10]
        for key in keys:
            expected = beta * a[key].float()
            got = wo[key].float() - w[key].float()
            scale = expected.abs().max().item() + 1e-30
            assert (got - expected).abs().max().item() <= 1e-5 * scale, key

    for run_id in ("W", "WO"):  # step 0 of their own: step, cursor, schedule from 0
        train_state = json.loads((_step(source, run_id, 1) / "train_state.json").read_text())
        assert train_state["step"] == 1 and train_state["consumed_samples"] == 8
    marker = (a4 / "COMMITTED").read_text().split()[0]  # the token the source committed
    recorded = json.loads((_step(source, "WO", 1) / "manifest.json").read_text())["init_from"]
    assert recorded == {"from": str(a4), "run_id": "A", "step": 4, "manifest": marker,
                        "load": "weights+optimizer"}  # fmt: skip

    listed = subprocess.run([sys.executable, "-m", "resiliency", "ls", str(source / "WO")],
                            cwd=REPO, text=True, capture_output=True, timeout=60)  # fmt: skip
    [row] = [ln for ln in listed.stdout.splitlines() if ln.startswith("attempt-01")]
    assert row.split()[1:5] == ["finished", "0", "-", "A@4"], listed.stdout  # restored from

    # A relaunch resumes its own step, whatever init_from says now, and keeps the record.
    again = _warm(tiny_overrides, source, "WO", "checkpoint.init_from=/nonexistent",
                  "train.train_steps=2", "checkpoint.schedule_on_resume=config")  # fmt: skip
    assert "resumed from step-000000001 at step 1" in again.stderr
    step2 = json.loads((_step(source, "WO", 2) / "manifest.json").read_text())
    assert step2["init_from"] == recorded


def launch_local(root: Path, tiny: list[str], *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "launch", "local", *tiny, f"output_dir={root}",
         "launch.nproc_per_node=2", "parallel.tp=1", *extra],
        cwd=REPO, text=True, capture_output=True, timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip


def test_a_source_that_cannot_be_used_is_refused_before_any_rank(
    source: Path, tiny_overrides: list[str], tmp_path: Path
) -> None:
    a4 = _step(source, "A", 4)
    broken = tmp_path / "broken" / "A"  # a copy whose shard lost its tail
    broken.parent.mkdir()
    subprocess.run(["cp", "-a", str(source / "A"), str(broken)], check=True)
    shard = next((RunLayout(broken.parent, "A").step_dir(4) / "model").glob("*.distcp"))
    os.truncate(shard, shard.stat().st_size - 1)
    cases = [
        (f"checkpoint.init_from={tmp_path / 'missing'}", exit_codes.CONFIG_ERROR,
         "no such file or directory"),
        (f"checkpoint.init_from={a4} model.num_layers=3", exit_codes.CONFIG_ERROR,
         "another model than this run's (model.num_layers: 4 -> 3)"),
        (f"checkpoint.init_from={a4} checkpoint.init_load=weights+optimizer "
         "optimizer.name=sgd", exit_codes.CONFIG_ERROR,
         "loads 'adam' state into optimizer.name='sgd'"),
        (f"checkpoint.init_from={RunLayout(broken.parent, 'A').step_dir(4)}",
         exit_codes.CHECKPOINT_IO, "does not verify"),
    ]  # fmt: skip
    for overrides, code, says in cases:
        run_id = f"R{uuid.uuid4().hex[:6]}"
        proc = launch_local(tmp_path, tiny_overrides, f"run_id={run_id}", *overrides.split())
        assert proc.returncode == code, (overrides, proc.stderr[-3000:])
        assert says in proc.stderr, proc.stderr[-3000:]
        assert "[rank 1]" not in proc.stderr and "Traceback" not in proc.stderr
        assert not (tmp_path / run_id).exists()  # nothing of the run was written
    # The run dir still verifies at step 2: its newest verified step is the one taken.
    proc = launch_local(tmp_path, tiny_overrides, "run_id=fallback", "train.train_steps=1",
                        f"checkpoint.init_from={broken}")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    recorded = json.loads((_step(tmp_path, "fallback", 1) / "manifest.json").read_text())
    assert recorded["init_from"]["step"] == 2


def test_from_the_object_store(
    source: Path, tiny_overrides: list[str], s3: S3Server, tmp_path: Path
) -> None:
    prefix = s3.url(f"warm-{uuid.uuid4().hex[:8]}")
    env = {**os.environ, **s3.env}
    os.environ.update(s3.env)
    try:
        store = ObjectStore(prefix, s3.endpoint_url, workers=4)
        upload_run(store, RunLayout(source, "A"), workers=4, keep_last=3)
    finally:
        for key in s3.env:
            os.environ.pop(key, None)
    _warm(tiny_overrides, tmp_path, "S", f"checkpoint.init_from={prefix}/A",
          f"checkpoint.remote.endpoint_url={s3.endpoint_url}", env=env)  # fmt: skip
    a = _weights(_state(_step(source, "A", 4), tmp_path))
    assert _worst(_weights(_state(_step(tmp_path, "S", 1), tmp_path)), a) < 1e-12
