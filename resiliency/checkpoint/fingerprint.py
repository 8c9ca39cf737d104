"""A fingerprint of one rank's live training state, recorded by a save and recomputed after a
restore (``checkpoint.fingerprint=true``): proof that the state a run continues from is the
state that was saved, tensor for tensor, not only that its files are intact.

What is fingerprinted: each model chunk's parameters as the forward pass uses them, and the
optimizer's own tensors (the distributed optimizer's fp32 main-parameter shards and Adam
moments). Per tensor, the wrapping int64 sum of its bit patterns and of their squares: exact
integer arithmetic, so equal on any device and in any reduction order, and a single flipped
bit changes it. Compared only when the restore keeps the layout (a rank's shards are then the
same tensors). Costs one read of the state per save and per restore: off by default.
"""

from __future__ import annotations

from typing import Any

import torch

# Bit-pattern views by element size (the float's bits as a same-sized integer).
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_CHUNK = 1 << 24  # elements summed at a time: bounds the int64 temporaries (128 MiB)


def tensor_digest(tensor: torch.Tensor) -> str:
    """``sum(bits):sum(bits^2)`` of the tensor's bit patterns, each wrapping at 2^64, hex."""
    flat = tensor.detach().contiguous().reshape(-1)
    bits = flat.view(_INT_OF_SIZE[flat.element_size()])
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    squares = torch.zeros((), dtype=torch.int64, device=flat.device)
    for start in range(0, bits.numel(), _CHUNK):
        part = bits[start : start + _CHUNK].to(torch.int64)
        total += part.sum()
        squares += (part * part).sum()
    mask = (1 << 64) - 1
    return f"{int(total) & mask:016x}:{int(squares) & mask:016x}"


def state_fingerprint(chunks: list[Any], optimizer: Any) -> dict[str, str]:
    """name -> digest for this rank's model parameters and optimizer tensors."""
    digests: dict[str, str] = {}
    for index, chunk in enumerate(chunks):
        for name, param in chunk.named_parameters():
            digests[f"model{index}.{name}"] = tensor_digest(param)
    for index, inner in enumerate(inner_optimizers(optimizer)):
        for group_index, group in enumerate(inner.param_groups):
            for position, param in enumerate(group["params"]):
                prefix = f"optimizer{index}.group{group_index}.{position}"
                digests[f"{prefix}.param"] = tensor_digest(param)
                for key, value in sorted(inner.state.get(param, {}).items()):
                    if isinstance(value, torch.Tensor) and value.numel() > 1:
                        digests[f"{prefix}.{key}"] = tensor_digest(value)
    return digests


def differences(saved: dict[str, str], restored: dict[str, str]) -> list[str]:
    """The tensors whose digest (or presence) differs, sorted, as 'name: saved -> restored'."""
    names = sorted(set(saved) | set(restored))
    return [
        f"{name}: {saved.get(name, 'absent')} -> {restored.get(name, 'absent')}"
        for name in names
        if saved.get(name) != restored.get(name)
    ]


def inner_optimizers(optimizer: Any) -> list[Any]:
    """The torch optimizers behind megatron's wrappers (chained for MoE, one otherwise)."""
    wrappers = getattr(optimizer, "chained_optimizers", [optimizer])
    return [getattr(w, "optimizer", w) for w in wrappers]
