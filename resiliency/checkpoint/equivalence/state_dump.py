"""One rank's whole training state as plain tensors and values, written to a file: what a run
that resumed must hold, bit for bit, where an uninterrupted run of the same config stood.

Keys (the comparison reports them as they are):

    model/<chunk>.<param>              the parameter as the forward pass uses it
    optimizer/<chunk>.<param>/<state>  the optimizer's tensors for the range of that parameter
                                       this rank owns: ``param`` (the fp32 main parameter),
                                       Adam's ``exp_avg``, ``exp_avg_sq`` and ``step``
    grad/<chunk>.<param>               the last step's reduced gradient over the same range
    rng/python, rng/numpy, rng/torch, rng/cuda, rng/tracker/<name>   every RNG stream
    values: loop/* (step, samples, LR, guard window...), scheduler/*, optimizer-group/*,
            data/next_batch (the digests of the samples this rank trains on next)

``ranges`` gives, per ``<chunk>.<param>``, the owned range of its flattened elements and its
size, so dumps taken at another data-parallel size can be put together whole.
"""

from __future__ import annotations

import pickle
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pretrain.data.dataset import microbatches
from resiliency.checkpoint.fingerprint import inner_optimizers
from resiliency.checkpoint.state_dict import chunks_by_key

if TYPE_CHECKING:
    from pretrain.train.view import TrainerView

FORMAT = 1


def dump_path(root: Path, step: int, rank: int) -> Path:
    return root / f"step-{step}" / f"rank-{rank:05d}.pt"


def _as_bytes(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj, protocol=4)), dtype=torch.uint8).clone()


def _rng_tensors(device: str) -> dict[str, torch.Tensor]:
    # Read here, not through pretrain/platform/rng.py's capture_rng: that is what the checkpoint
    # saves, so a stream it forgets would be missing from both sides of the comparison too.
    # megatron-core: imported after the CPU shim is applied (pretrain/platform/distributed.py)
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state = {
        "rng/python": _as_bytes(random.getstate()),
        "rng/numpy": _as_bytes(np.random.get_state()),
        "rng/torch": torch.get_rng_state(),
    }
    if device == "cuda":
        state["rng/cuda"] = torch.cuda.get_rng_state().cpu()
    for name, value in sorted(get_cuda_rng_tracker().get_states().items()):
        state[f"rng/tracker/{name}"] = value.detach().cpu().clone()
    return state


def _owned(optimizer: Any, param: torch.Tensor) -> tuple[Any, int, int] | None:
    """(the megatron DistributedOptimizer holding ``param``, start, end of this rank's range;
    end == start where other DP ranks own all of it), or None: no distributed optimizer."""
    wrappers = getattr(optimizer, "chained_optimizers", [optimizer])
    if not all(hasattr(w, "model_param_gbuf_map") for w in wrappers):
        return None
    for wrapper in wrappers:
        # megatron maps only the params this DP rank owns a range of
        if param in wrapper.model_param_gbuf_map:
            owned = wrapper._get_model_param_range_map(param)["param"]
            return wrapper, owned.start, owned.end
    return wrappers[0], 0, 0


def _optimizer_tensors(
    optimizer: Any, named: dict[str, torch.Tensor], with_grads: bool
) -> tuple[dict[str, torch.Tensor], dict[str, list[int]]]:
    """The optimizer's (and with ``with_grads`` the gradients') tensors by parameter name, and
    each one's range. (Adam's step counter is among the optimizer's per-parameter tensors.)"""
    tensors: dict[str, torch.Tensor] = {}
    ranges: dict[str, list[int]] = {}
    unowned = []
    for name, param in named.items():
        owner = _owned(optimizer, param)
        if owner is None:
            unowned.append((name, param))
            continue
        wrapper, start, end = owner
        if end <= start:
            continue
        ranges[name] = [start, end, param.numel()]
        for key, value in wrapper._get_main_param_and_optimizer_states(param).items():
            tensors[f"optimizer/{name}/{key}"] = value.detach().cpu().clone().reshape(-1)
        grad = getattr(param, "main_grad", None)
        if with_grads and grad is not None:
            tensors[f"grad/{name}"] = grad.detach().reshape(-1)[start:end].cpu().clone()
    if unowned:  # not a distributed optimizer: its own tensors, by position
        tensors.update(_positional(optimizer, dict(unowned), with_grads))
    return tensors, ranges


def _positional(
    optimizer: Any, named: dict[str, torch.Tensor], with_grads: bool
) -> dict[str, torch.Tensor]:
    by_param = {id(p): name for name, p in named.items()}
    tensors = {}
    for index, inner in enumerate(inner_optimizers(optimizer)):
        for g, group in enumerate(inner.param_groups):
            for position, param in enumerate(group["params"]):
                name = by_param.get(id(param), f"{index}.group{g}.{position}")
                for key, value in inner.state.get(param, {}).items():
                    if isinstance(value, torch.Tensor):
                        tensors[f"optimizer/{name}/{key}"] = value.detach().cpu().clone()
                tensors[f"optimizer/{name}/param"] = param.detach().cpu().clone()
    for name, param in named.items():
        grad = getattr(param, "main_grad", None)
        if with_grads and grad is not None:
            tensors[f"grad/{name}"] = grad.detach().cpu().clone()
    return tensors


def _scalars(prefix: str, mapping: dict[str, Any]) -> dict[str, Any]:
    """Plain values (a group's tensors, its params, are the optimizer/* tensors' business)."""
    plain = {key: _plain(value) for key, value in sorted(mapping.items()) if key != "params"}
    return {f"{prefix}/{key}": value for key, value in plain.items() if value is not _SKIP}


_SKIP = object()


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else _SKIP
    if isinstance(value, (list, tuple)):
        items = [_plain(v) for v in value]
        return _SKIP if any(v is _SKIP for v in items) else items
    if isinstance(value, dict):
        return {k: v for k, v in ((k, _plain(v)) for k, v in value.items()) if v is not _SKIP}
    return value if isinstance(value, (bool, int, float, str)) or value is None else _SKIP


def _read_by(inner: Any, group: dict[str, Any]) -> dict[str, Any]:
    """The group's settings its optimizer reads. A group's "step" is megatron's copy, set on
    load for fused Adams that count there, when every parameter counts its own (torch's Adam:
    compared as optimizer/<param>/step); an uninterrupted run never has it."""
    per_param = group["params"] and all("step" in inner.state.get(p, {}) for p in group["params"])
    return {k: v for k, v in group.items() if not (k == "step" and per_param)}


def capture(trainer: TrainerView, grads_of: int | None) -> dict[str, Any]:
    """This rank's state now: tensors, values, ranges and the layout it was taken on.
    ``grads_of``: the step whose gradients the grad buffers hold (trained in this process),
    None after a restore (gradients are not state: every step starts from zero)."""
    parts = trainer.parts
    named = {
        f"{key}.{name}": param
        for key, chunk in chunks_by_key(parts.chunks).items()
        for name, param in chunk.named_parameters()
    }
    tensors = {f"model/{name}": p.detach().cpu().clone() for name, p in named.items()}
    optim, ranges = _optimizer_tensors(parts.optimizer, named, grads_of is not None)
    tensors.update(optim)
    tensors.update(_rng_tensors(trainer.env.device))
    values = _scalars("loop", trainer.state_dict())
    values.update(_scalars("scheduler", parts.scheduler.state_dict()))
    for index, inner in enumerate(inner_optimizers(parts.optimizer)):
        for g, group in enumerate(inner.param_groups):
            values.update(_scalars(f"optimizer-group/{index}.{g}", _read_by(inner, group)))
    digests: list[int] = []
    microbatches(parts.dataset, parts.plan, trainer.state.consumed_samples, digests)
    values["data/next_batch"] = digests
    return {
        "format": FORMAT,
        "layout": _layout(trainer),
        "step": trainer.state.step,
        "grads_of": grads_of,
        "tensors": tensors,
        "values": values,
        "ranges": ranges,
    }


def _layout(trainer: TrainerView) -> dict[str, Any]:
    # megatron-core: imported after the CPU shim is applied (pretrain/platform/distributed.py)
    from megatron.core import parallel_state as ps

    par = trainer.run.parallel
    return {
        "rank": trainer.env.rank,
        "world": trainer.env.world_size,
        "dp": trainer.dp,
        "tp": par.tp,
        "pp": par.pp,
        "ep": par.ep,
        "cp": par.cp,
        "vpp": par.vpp,
        "model_rank": [ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()],
        "dp_rank": ps.get_data_parallel_rank(),
    }


def write(dump: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(dump, tmp)
    tmp.replace(path)


def read(path: Path) -> dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=False)
