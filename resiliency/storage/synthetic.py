"""Small, fake but protocol-complete checkpoints, for tests and storage drills (no torch)."""

from __future__ import annotations

import json
import random
from pathlib import Path

from resiliency.storage.checksum import describe_files
from resiliency.storage.layout import RunLayout, payload_files
from resiliency.storage.manifest import Manifest, merge_file_entries
from resiliency.storage.publish import begin_step, publish, write_manifest_and_commit

# Mimics a megatron-core dist checkpoint plus our per-rank and train state files.
SHARD_SIZES = {
    "model/__0_0.distcp": 4096,
    "model/__1_0.distcp": 3072,
    "model/metadata.json": 0,
    "rank-state/rank-00000.pt": 1024,
    "rank-state/rank-00001.pt": 1024,
}


def write_payload(step_dir: Path, step: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed * 1_000_003 + step)
    for rel, size in SHARD_SIZES.items():
        path = step_dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        data = (
            json.dumps({"step": step, "shards": 2}).encode() if size == 0 else rng.randbytes(size)
        )
        path.write_bytes(data)
    (step_dir / "train_state.json").write_text(json.dumps({"step": step, "tokens": step * 4096}))
    return payload_files(step_dir)


def synthetic_manifest(
    layout: RunLayout,
    step: int,
    attempt: int,
    tmp: Path,
    world_size: int = 2,
    algorithm: str = "crc32c",
) -> Manifest:
    files = payload_files(tmp)
    # Each "rank" describes its own share, as real ranks would before the coordinator gathers.
    groups = [
        describe_files(tmp, files[r::world_size], algorithm, fsync=False) for r in range(world_size)
    ]
    return Manifest(
        run_id=layout.run_id,
        attempt=attempt,
        step=step,
        world_size=world_size,
        parallelism={"tp": 1, "pp": 1, "cp": 1, "ep": 1, "vpp": 1, "dp": world_size},
        optim_format="synthetic",
        files=merge_file_entries(groups),
    )


def write_synthetic_step(
    layout: RunLayout, step: int, attempt: int = 1, seed: int = 0, do_publish: bool = True
) -> Path:
    """Write, commit and (by default) publish a fake step; returns its dir."""
    tmp = begin_step(layout, step, attempt)
    write_payload(tmp, step, seed)
    write_manifest_and_commit(tmp, synthetic_manifest(layout, step, attempt, tmp))
    return publish(layout, tmp, step) if do_publish else tmp


def write_random_step(layout: RunLayout, step: int, files: int, size: int) -> Path:
    """Publish a step of ``files`` random ``model/__<i>_0.distcp`` files of ``size`` bytes each
    (seeded by the step): a payload of chosen shape for transfer tests."""
    tmp = begin_step(layout, step, 1)
    rng = random.Random(step)
    for i in range(files):
        path = tmp / "model" / f"__{i}_0.distcp"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(rng.randbytes(size))
    manifest = Manifest(run_id=layout.run_id, attempt=1, step=step, world_size=1,
                        files=describe_files(tmp, payload_files(tmp), fsync=False))  # fmt: skip
    write_manifest_and_commit(tmp, manifest)
    return publish(layout, tmp, step)
