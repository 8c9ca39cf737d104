"""Worker (one process, gloo world of 1): megatron's sharded save with in-process writers.

Saves the same sharded tensors twice, once with megatron's own write function and once with
``in_process_writes``, counting forks around each; loads both back; then saves into a dir
that vanished before the write. Writes {"megatron_forks", "in_process_forks", "equal",
"crc_option_after", "zip_crcs_set", "files", "missing_dir_error"} as JSON to argv[1].
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

warnings.simplefilter("ignore")
FORKS = [0]


def sharded_state() -> dict[str, Any]:
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    torch.manual_seed(0)
    shapes = {"big": (1 << 21,), "matrix": (512, 384), "small": (7,), "empty_ish": (1,)}
    return {
        name: ShardedTensor.from_rank_offsets(name, torch.randn(shape))
        for name, shape in shapes.items()
    }


def save_request(directory: Path, thread_count: int) -> Any:
    """megatron's planned (not yet written) save of ``sharded_state()`` into ``directory``."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    directory.mkdir(parents=True, exist_ok=True)
    strategy = TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=thread_count)
    return dist_checkpointing.save(
        sharded_state(), str(directory), sharded_strategy=strategy, async_sharded_save=True
    )


def save(directory: Path, in_process: bool) -> int:
    from resiliency.checkpoint.write.shard_writer import in_process_writes

    request = save_request(directory, thread_count=2)
    before = FORKS[0]
    (in_process_writes(request) if in_process else request).execute_sync()
    return FORKS[0] - before


def load(directory: Path) -> dict[str, Any]:
    from megatron.core import dist_checkpointing

    return dist_checkpointing.load(sharded_state(), str(directory))


def zip_crcs(directory: Path) -> list[int]:
    """CRC-32 fields of the zip central directories of the torch.save records in the shards."""
    import struct

    crcs = []
    for path in sorted(directory.glob("*.distcp")):
        data = path.read_bytes()
        at = data.find(b"PK\x01\x02")
        while at >= 0:
            crcs.append(struct.unpack_from("<I", data, at + 16)[0])
            at = data.find(b"PK\x01\x02", at + 4)
    return crcs


def main() -> None:
    out = Path(sys.argv[1])
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import torch
    import torch.distributed as dist

    from pretrain.platform import cpu_shim

    cpu_shim.apply()  # megatron's preload synchronizes CUDA
    work = Path(tempfile.mkdtemp(prefix="shard-writes-"))
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{work / 'store'}")
    os.register_at_fork(before=lambda: FORKS.__setitem__(0, FORKS[0] + 1))
    report: dict[str, Any] = {}
    report["megatron_forks"] = save(work / "megatron", in_process=False)
    report["in_process_forks"] = save(work / "threads", in_process=True)
    report["crc_option_after"] = torch.serialization.get_crc32_options()
    expected = {k: v.data for k, v in sharded_state().items()}
    ours, theirs = load(work / "threads"), load(work / "megatron")
    report["equal"] = all(
        torch.equal(ours[k], expected[k]) and torch.equal(theirs[k], expected[k]) for k in expected
    )
    report["zip_crcs_set"] = {
        name: sum(1 for c in zip_crcs(work / name) if c) for name in ("megatron", "threads")
    }
    report["files"] = sorted(p.name for p in (work / "threads").glob("*.distcp"))
    gone = work / "gone"
    try:
        from resiliency.checkpoint.write.shard_writer import in_process_writes

        request = save_request(gone, thread_count=1)
        shutil.rmtree(gone)
        in_process_writes(request).execute_sync()
        report["missing_dir_error"] = None
    except BaseException as exc:  # noqa: BLE001 - the report says what came out
        report["missing_dir_error"] = f"{type(exc).__name__}: {exc}"
    out.write_text(json.dumps(report))
    dist.destroy_process_group()
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
