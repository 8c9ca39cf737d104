"""Worker (one process, gloo world of 1): megatron's load through the streaming reader.

Saves sharded tensors of several dtypes with megatron's own writer (zip CRCs set) and with the
in-process writers (no CRCs), then loads each back twice: with megatron's own reader and through
``compat.checkpoint_reader(StreamingReader)``, whole and as a row chunk (one contiguous run of
bytes: read into place) and a column chunk (not contiguous: torch's own path). The streaming
reader also checks the shard files against their crc32c (a share check holding all of them):
the verdicts per case, then again after one byte of the file is inverted at its very end (the
archive's directory, a byte the load never places) and in its middle (tensor data). Writes
{"equal": {case: bool}, "stats": {case: [streamed, fallback]}, "reader_calls",
"verdicts": {case: {"checked": [file], "problem"}}, "corrupt": {where: the same}} to argv[1].
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

warnings.simplefilter("ignore")
SHAPES = {"matrix": (512, 384), "vector": (1 << 16,), "one": (1,)}
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "i64": "int64"}


def values() -> dict[str, Any]:
    import torch

    gen = torch.Generator().manual_seed(0)
    out = {}
    for dname, dtype in DTYPES.items():
        for name, shape in SHAPES.items():
            full = torch.randn(shape, generator=gen) * 1000
            out[f"{name}.{dname}"] = full.to(getattr(torch, dtype))
    return out


def targets(part: str) -> dict[str, Any]:
    """What a load asks for: the whole tensors, or one of two row / column chunks of the
    matrices (the other tensors whole)."""
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    wanted = {}
    for key, tensor in values().items():
        if part == "whole" or not key.startswith("matrix"):
            wanted[key] = ShardedTensor.from_rank_offsets(key, torch.zeros_like(tensor))
            continue
        axis = 0 if part == "rows" else 1
        half = list(tensor.shape)
        half[axis] //= 2
        local = torch.zeros(half, dtype=tensor.dtype)
        wanted[key] = ShardedTensor.from_rank_offsets(key, local, (axis, 1, 2))
    return wanted


def expected(part: str) -> dict[str, Any]:
    out = {}
    for key, tensor in values().items():
        if part == "whole" or not key.startswith("matrix"):
            out[key] = tensor
        elif part == "rows":
            out[key] = tensor[tensor.shape[0] // 2 :]
        else:
            out[key] = tensor[:, tensor.shape[1] // 2 :]
    return out


def save(directory: Path, ours: bool) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    from resiliency.checkpoint.write.shard_writer import in_process_writes

    directory.mkdir(parents=True)
    state = {k: ShardedTensor.from_rank_offsets(k, v) for k, v in values().items()}
    strategy = TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=2)
    request = dist_checkpointing.save(
        state, str(directory), sharded_strategy=strategy, async_sharded_save=True
    )
    (in_process_writes(request) if ours else request).execute_sync()


def saved_entries(directory: Path) -> list[Any]:
    """Each shard file of ``directory`` as saved (keys as in a step dir)."""
    from resiliency.storage.checksum import FileEntry, file_checksum

    return [
        FileEntry(f"model/{f.name}", f.stat().st_size, file_checksum(f))
        for f in sorted(directory.glob("*.distcp"))
    ]


def checked_load(
    directory: Path, part: str, entries: list[Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A streaming load with every file of ``entries`` given to the read to check: what it
    loaded, the files it checked to their end and the first mismatch it found."""
    from megatron.core import dist_checkpointing

    from pretrain.platform import compat
    from resiliency.checkpoint.restore.share_check import ShareCheck
    from resiliency.checkpoint.restore.streaming import StreamingReader

    check = ShareCheck({e.path: e for e in entries}, reads_shards=True)
    with compat.checkpoint_reader(lambda path: StreamingReader(path, check)):
        loaded = dist_checkpointing.load(
            targets(part), str(directory), validate_access_integrity=False
        )
    check.release()
    return loaded, {"checked": sorted(check.checked_paths), "problem": check.problem}


def flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def main() -> None:
    out = Path(sys.argv[1])
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from pretrain.platform import compat, cpu_shim
    from resiliency.checkpoint.restore.streaming import StreamingReader

    cpu_shim.apply()
    work = Path(tempfile.mkdtemp(prefix="streaming-load-"))
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{work / 'store'}")
    report: dict[str, Any] = {
        "equal": {},
        "stats": {},
        "reader_calls": 0,
        "verdicts": {},
        "corrupt": {},
    }
    saved = {}
    for writer in ("megatron", "ours"):
        save(work / writer, ours=writer == "ours")
        saved[writer] = saved_entries(work / writer)
        for part in ("whole", "rows", "columns"):
            case = f"{writer}/{part}"
            readers: list[StreamingReader] = []

            def make(path: Any, readers: list = readers) -> StreamingReader:
                readers.append(StreamingReader(path))
                return readers[-1]

            theirs = dist_checkpointing.load(
                targets(part), str(work / writer), validate_access_integrity=False
            )
            with compat.checkpoint_reader(make):
                mine = dist_checkpointing.load(
                    targets(part), str(work / writer), validate_access_integrity=False
                )
            want = expected(part)
            report["equal"][case] = all(
                torch.equal(mine[k], want[k]) and torch.equal(theirs[k], want[k]) for k in want
            )
            report["reader_calls"] += len(readers)
            stats = readers[0].stats if readers else None
            report["stats"][case] = [stats.streamed_items, stats.fallback_items] if stats else None
            checked, report["verdicts"][case] = checked_load(work / writer, part, saved[writer])
            report["equal"][case] &= all(torch.equal(checked[k], want[k]) for k in want)
    shard = sorted((work / "ours").glob("*.distcp"))[0]
    for where, at in (("end", shard.stat().st_size - 1), ("middle", shard.stat().st_size // 2)):
        flip(shard, at)
        report["corrupt"][where] = checked_load(work / "ours", "whole", saved["ours"])[1]
        flip(shard, at)  # back as saved
    out.write_text(json.dumps(report))
    dist.destroy_process_group()
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
