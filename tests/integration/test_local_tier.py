"""Node-local tier: two simulated nodes (two torchrun launchers, one rank each, own local dirs).

Local saves every 2 steps, persistent every 5; runs are SIGKILLed before step 9, so the newest
local step (8) is newer than the newest persistent one (5). Every resumed run is compared bit
for bit with the uninterrupted reference run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

from pretrain.platform.host import free_port
from resiliency.checkpoint.local.store import (
    REJECTED_SUFFIX,
    VerifiedLocalManager,
    list_local_files,
)
from tests.helpers import REPO, TORCHRUN, losses, read_steps

# The current-stack leg runs the peer-replica restore (a local-tier save and load through
# megatron-core, exact against the persistent run) and the unit tests; the other restores
# and the fallbacks are this package's own logic (leg 1 only).
pytestmark = pytest.mark.slow

STEPS, KILL_AT, LOCAL_STEP, PERSISTENT_STEP = 12, 9, 8, 5
# Data parallel with the distributed optimizer: each rank's shard holds its own optimizer slice.
LAYOUT = ["parallel.tp=1", "optimizer.use_distributed_optimizer=true"]


def run_two_nodes(overrides: list[str], timeout: float = 300) -> list[subprocess.CompletedProcess]:
    """One launcher per simulated node; torchrun sets GROUP_RANK (node) and LOCAL_WORLD_SIZE=1.

    Output goes to files: a launcher blocked on a full pipe would stall the other's collectives.
    """
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as logs:
        procs, streams = [], []
        for node in (0, 1):
            out = open(Path(logs) / f"node{node}.out", "w+")
            err = open(Path(logs) / f"node{node}.err", "w+")
            streams.append((out, err))
            procs.append(
                subprocess.Popen(
                    [
                        TORCHRUN,
                        "--nnodes=2",
                        f"--node-rank={node}",
                        "--nproc-per-node=1",
                        "--master-addr=127.0.0.1",
                        f"--master-port={port}",
                        "-m",
                        "pretrain",
                        *overrides,
                    ],
                    cwd=REPO,
                    env=env,
                    text=True,
                    stdout=out,
                    stderr=err,
                )
            )
        results = []
        for proc, (out, err) in zip(procs, streams):
            proc.wait(timeout=timeout)
            out.seek(0)
            err.seek(0)
            results.append(
                subprocess.CompletedProcess(proc.args, proc.returncode, out.read(), err.read())
            )
            out.close()
            err.close()
    return results


def _ok(results: list[subprocess.CompletedProcess]) -> str:
    for result in results:
        assert result.returncode == 0, result.stderr[-6000:]
    return results[0].stderr


def _overrides(tiny: list[str], root: Path, run_id: str, *extra: str) -> list[str]:
    return [
        *tiny,
        *LAYOUT,
        f"output_dir={root / 'runs'}",
        f"run_id={run_id}",
        f"train.train_steps={STEPS}",
        "checkpoint.save_interval=5",
        "checkpoint.local.interval=2",
        f"checkpoint.local.dir={root / 'local'}",
        *extra,
    ]


def _killed_run(tiny: list[str], root: Path, run_id: str, *extra: str) -> None:
    results = run_two_nodes(_overrides(tiny, root, run_id, f"train.fault=kill@{KILL_AT}", *extra))
    assert all(r.returncode != 0 for r in results)
    rank_dirs = list((root / "local").glob(f"node-*/{run_id}/*"))
    assert {f.step for d in rank_dirs for f in list_local_files(d)} == {6, LOCAL_STEP}


def _attempt(root: Path, run_id: str, attempt: int) -> dict:
    return json.loads(
        (root / "runs" / run_id / "attempts" / f"attempt-{attempt:02d}.json").read_text()
    )


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, tiny_overrides: list[str]) -> Path:
    root = tmp_path_factory.mktemp("local-ref")
    _ok(run_two_nodes(_overrides(tiny_overrides, root, "ref")))
    return root


def _assert_exact_from(root: Path, run_id: str, reference: Path, first: int) -> None:
    ref, resumed = losses(reference / "runs" / "ref"), read_steps(root / "runs" / run_id)
    assert [resumed[s]["loss"] for s in range(first, STEPS + 1)] == ref[first - 1 :]


def test_planned_exit_is_persistent_even_after_a_local_save(reference: Path) -> None:
    records = [
        json.loads(line)
        for line in (reference / "runs" / "ref" / "metrics" / "checkpoints.jsonl")
        .read_text()
        .splitlines()
    ]
    assert [(r["tier"], r["step"]) for r in records][-1] == ("local", STEPS)  # 12 % 2 == 0
    assert (reference / "runs" / "ref" / "steps" / f"step-{STEPS:09d}" / "COMMITTED").is_file()
    kept = {f.step for f in list_local_files(reference / "local" / "node-001" / "ref" / "1")}
    assert kept == {8, 12}  # keep_last=2 (10 was a persistent step)


def test_exact_resume_from_the_local_tier(
    tmp_path: Path, tiny_overrides: list[str], reference: Path
) -> None:
    _killed_run(tiny_overrides, tmp_path, "own")
    log = _ok(run_two_nodes(_overrides(tiny_overrides, tmp_path, "own")))
    assert f"newer than persistent step {PERSISTENT_STEP}" in log
    assert f"local tier: step {LOCAL_STEP} from rank 0: own copy, " in log
    assert "; rank 1: own copy, " in log
    assert _attempt(tmp_path, "own", 2)["restored_tier"] == "local"
    assert _attempt(tmp_path, "own", 2)["restored_step"] == LOCAL_STEP
    _assert_exact_from(tmp_path, "own", reference, LOCAL_STEP + 1)


@pytest.mark.current_stack
def test_node_loss_restores_from_the_peer_replica(
    tmp_path: Path, tiny_overrides: list[str], reference: Path
) -> None:
    _killed_run(tiny_overrides, tmp_path, "lost")
    shutil.rmtree(tmp_path / "local" / "node-001")  # node 1 and its disk are gone
    log = _ok(run_two_nodes(_overrides(tiny_overrides, tmp_path, "lost")))
    # Each rank says which copy it loaded: rank 1's own node is gone, node 0 held its replica.
    assert f"local tier: step {LOCAL_STEP} from rank 0: own copy, " in log
    assert "; rank 1: replica held by rank 0 on node-000" in log
    assert _attempt(tmp_path, "lost", 2)["restored_step"] == LOCAL_STEP
    _assert_exact_from(tmp_path, "lost", reference, LOCAL_STEP + 1)
    listing = subprocess.run(
        [
            str(Path(TORCHRUN).with_name("python")),
            "-m",
            "resiliency",
            "ls",
            str(tmp_path / "runs" / "lost"),
        ],
        cwd=REPO,
        text=True,
        capture_output=True,
        check=True,
    ).stdout
    assert "local tier:" in listing and "node-000 rank 0 (replica)" in listing


def test_corrupt_replica_and_lost_primary_fall_back_to_persistent(
    tmp_path: Path, tiny_overrides: list[str], reference: Path
) -> None:
    _killed_run(tiny_overrides, tmp_path, "bad")
    node0, node1 = (tmp_path / "local" / f"node-00{n}" / "bad" / str(n) for n in (0, 1))
    (node1 / f"iter_{LOCAL_STEP:07d}_1_local.pt").unlink()  # the primary copy
    replica = node0 / f"iter_{LOCAL_STEP:07d}_1_local.pt"
    data = bytearray(replica.read_bytes())
    data[len(data) // 2] ^= 0x01
    replica.write_bytes(bytes(data))
    for d in (node0, node1):  # and the older step too, so only the persistent tier is left
        for f in list_local_files(d):
            if f.step == 6:
                f.path.unlink()
    log = _ok(run_two_nodes(_overrides(tiny_overrides, tmp_path, "bad")))  # one restart only
    assert "(corrupt); renamed *.rejected" in log
    assert (node0 / f"iter_{LOCAL_STEP:07d}_1_local.pt{REJECTED_SUFFIX}").is_file()
    assert _attempt(tmp_path, "bad", 2)["restored_tier"] == "persistent"
    _assert_exact_from(tmp_path, "bad", reference, PERSISTENT_STEP + 1)


def test_topology_change_skips_the_local_tier(tmp_path: Path, tiny_overrides: list[str]) -> None:
    _killed_run(tiny_overrides, tmp_path, "topo")
    log = _ok(run_two_nodes(_overrides(tiny_overrides, tmp_path, "topo", "parallel.tp=2")))
    assert "local tier skipped: saved with a different run/topology (parallelism:" in log
    assert _attempt(tmp_path, "topo", 2)["restored_step"] == PERSISTENT_STEP


@pytest.mark.current_stack
def test_store_rejects_a_flipped_byte_once_and_keeps_two_steps(tmp_path: Path) -> None:
    manager = VerifiedLocalManager(tmp_path, "run", {"world_size": 1}, keep_last=2)
    manager._rank = 0  # no process group needed for the file side
    for step in (1, 2, 3):
        manager._save({"w": torch.full((4,), float(step))}, (step, 0, "run"))
    manager._cleanup(3)
    assert [i[0] for i in sorted(manager._my_ckpt_ids())] == [2, 3]
    path = manager.rank_dir / "iter_0000003_0_local.pt"
    data = bytearray(path.read_bytes())
    data[-30] ^= 0xFF
    path.write_bytes(bytes(data))
    fresh = VerifiedLocalManager(tmp_path, "run", {"world_size": 1}, keep_last=2)
    fresh._rank = 0
    assert [i[0] for i in fresh._my_ckpt_ids()] == [2]
    assert [i[0] for i in fresh._my_ckpt_ids()] == [2]  # rejected once, not re-examined
    assert sorted(p.name for p in fresh.rank_dir.glob("*" + REJECTED_SUFFIX)) == [
        "iter_0000003_0_local.pt.meta.json.rejected",
        "iter_0000003_0_local.pt.rejected",
    ]
    assert torch.equal(fresh._load((2, 0, "run"))["w"], torch.full((4,), 2.0))


@pytest.mark.current_stack
def test_dirty_files_of_dead_attempts_are_removed(tmp_path: Path) -> None:
    manager = VerifiedLocalManager(tmp_path, "run", {"world_size": 1}, keep_last=2)
    manager._rank = 0
    manager._save({"w": torch.ones(2)}, (4, 0, "run"))
    dead = manager.rank_dir / "iter_0000005_0_local.dirty.pt"  # killed mid-write
    dead.write_bytes(b"partial")
    assert [i[0] for i in manager._my_ckpt_ids()] == [4]
    manager.discard_after(4)
    assert sorted(p.name for p in manager.rank_dir.iterdir()) == [
        "iter_0000004_0_local.pt",
        "iter_0000004_0_local.pt.meta.json",
    ]


@pytest.mark.current_stack
def test_replicas_must_land_on_other_nodes() -> None:
    from recipes import ConfigError
    from recipes.config.checkpoint import LocalCheckpointConfig
    from resiliency.checkpoint.local.tier import replication_strategy

    cfg = LocalCheckpointConfig(interval=5, dir="/x", replication_factor=2, replication_jump=2)
    with pytest.raises(ConfigError, match="different node.*replication_factor=1"):
        replication_strategy(cfg, world_size=2)  # one node of 2 ranks: no other node
