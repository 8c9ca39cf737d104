"""torchrun worker: the staged fully-reshardable optimizer state equals megatron's own.

Trains a few steps, then compares ``sharded_training_state`` built by megatron with the one
built into staging buffers (twice, with a step between, so reused buffers must be refreshed).
A sync save's variant (``snapshot=False``) must equal it too, with whole live tensors left in
place. Rank 0 writes every rank's {"compared", "fast_tensors", "non_tensors", "mismatches",
"in_place", "in_place_mismatches", "shared_with_model", ...} to ``--out``.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

warnings.simplefilter("ignore")


def _leaves(value: Any, path: str = "") -> list[tuple[str, Any]]:
    if isinstance(value, dict):
        return [leaf for k, v in value.items() for leaf in _leaves(v, f"{path}/{k}")]
    if isinstance(value, (list, tuple)):
        return [leaf for i, v in enumerate(value) for leaf in _leaves(v, f"{path}/{i}")]
    return [(path, value)]


def _described(sharded: dict[str, Any]) -> dict[str, Any]:
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    out = {}
    for path, value in _leaves(sharded):
        if isinstance(value, ShardedTensor):
            meta = (
                value.key,
                value.dtype,
                tuple(value.local_shape),
                tuple(value.global_shape),
                tuple(value.global_offset),
                value.axis_fragmentations,
                value.replica_id,
                value.flattened_range,
            )
            out[path] = (meta, value.data)
        elif isinstance(value, ShardedTensorFactory):  # SwiGLU's fc1; its repr names closures
            out[path] = ((value.key, value.replica_id, value.flattened_range), value.data)
        else:
            out[path] = (repr(value), None)
    return out


def compare(ref: dict[str, Any], fast: dict[str, Any]) -> list[str]:
    import torch

    a, b = _described(ref), _described(fast)
    problems = [f"keys differ: {sorted(set(a) ^ set(b))[:5]}"] if set(a) != set(b) else []
    for path in sorted(set(a) & set(b)):
        (meta_a, data_a), (meta_b, data_b) = a[path], b[path]
        if meta_a != meta_b:
            problems.append(f"{path}: {meta_a} != {meta_b}")
        elif data_a is not None and not torch.equal(data_a, data_b):
            problems.append(f"{path}: values differ")
    return problems


def _shared_with_model(sharded: dict[str, Any]) -> int:
    """Optimizer records written from the very buffer a model record is (fp32 main params)."""
    model = {id(data) for _, data in _described(sharded["model"]).values() if data is not None}
    return sum(1 for _, data in _described(sharded["optimizer"]).values() if id(data) in model)


def _reserved_save(parts: Any) -> tuple[list[str], dict[str, Any]]:
    """A dry run sizes shared buffers, reserved on a thread; then the save's state as an async
    save stages it. Returns the buffers that save had to allocate or replace, and the state."""
    from resiliency.checkpoint.state_dict import sharded_training_state
    from resiliency.checkpoint.write.staging import StagingBuffers, StagingPlan, stage_sharded_state

    plan = StagingPlan(shared=True)
    stage_sharded_state(sharded_training_state(parts, "fully_reshardable", staging=plan), plan)
    reserved = StagingBuffers(shared=True)
    reserved.reserve_in_background(plan.entries)
    before = {key: id(buf) for key, buf in reserved.buffers().items()}
    state = sharded_training_state(parts, "fully_reshardable", staging=reserved)
    stage_sharded_state(state, reserved)
    after = reserved.buffers()
    misses = [k for k, buf in after.items() if before.get(k) != id(buf) or not buf.is_shared()]
    return misses + [k for k in before if k not in after], state


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from resiliency.checkpoint.state_dict import sharded_training_state
    from resiliency.checkpoint.write.staging import StagingBuffers
    from tests.workers.trainer_worker import build_trainer, gather_to

    args, trainer = build_trainer()
    staging = StagingBuffers()
    report: dict[str, Any] = {
        "compared": 0,
        "fast_tensors": 0,
        "non_tensors": 0,
        "mismatches": [],
        "in_place": 0,
        "in_place_mismatches": [],
        "reserve_misses": [],
        "reserved_mismatches": [],
        "shared_with_model": 0,
    }
    for _ in range(2):
        trainer.train_step()
        ref = sharded_training_state(trainer.parts, "fully_reshardable")
        fast = sharded_training_state(trainer.parts, "fully_reshardable", staging=staging)
        report["mismatches"] += compare(ref["optimizer"], fast["optimizer"])
        # A sync save's state (no snapshot): whole live tensors are used as they are.
        sync = sharded_training_state(
            trainer.parts, "fully_reshardable", staging=staging, snapshot=False
        )
        report["in_place_mismatches"] += compare(ref["optimizer"], sync["optimizer"])
        report["shared_with_model"] += _shared_with_model(fast) + _shared_with_model(sync)
        report["in_place"] += sum(
            1
            for _, data in _described(sync["optimizer"]).values()
            if data is not None and not staging.owns(data)
        )
        if not report["compared"]:  # once: buffers reserved ahead serve the first save
            report["reserve_misses"], reserved = _reserved_save(trainer.parts)
            report["reserved_mismatches"] = compare(ref, reserved)
        described = _described(fast["optimizer"])
        report["compared"] += len(described)
        report["non_tensors"] += sum(1 for _, data in described.values() if data is None)
        report["fast_tensors"] += sum(
            1 for _, data in described.values() if data is not None and staging.owns(data)
        )
    gather_to(args.out, report)


if __name__ == "__main__":
    main()
