"""The globals a checkpoint's pickles may name: the checkpoint loader's allow-list.

A pickle runs code only through the globals it names, so a checkpoint file that names anything
else is refused unread: statically by ``python -m resiliency verify`` and the restore's re-hash
(resiliency/storage/pickle_scan.py), and again at load time (pretrain/platform/compat.py's
restricted loads). Measured by saving real checkpoints on both stacks (TP=2, PP=2, DP=2 with the
distributed optimizer, MoE EP=2; ``fully_reshardable`` and ``dp_reshardable``; the node-local
tier; two saves per run, sync and async) and listing every GLOBAL of their pickles:
tests/integration/test_safe_load.py re-measures it on each stack.
Torch-free (stdlib only): the storage layer, which loads no torch, imports it.
"""

from __future__ import annotations

import functools
from importlib.metadata import PackageNotFoundError, version

from pretrain.context import exit_codes
from pretrain.context.failures import ClassifiedError

Global = tuple[str, str]  # (module, qualname), as a pickle's GLOBAL / STACK_GLOBAL names it

_DCP = "torch.distributed.checkpoint"
# model/.metadata: torch DCP's Metadata (a raw pickle) and what it holds; the planner classes
# are megatron's cached save plan, kept in the metadata (_StoragePrefix: from a run's second
# save on, when the plan is reused).
DCP_METADATA: frozenset[Global] = frozenset(
    {
        (f"{_DCP}.metadata", "Metadata"),
        (f"{_DCP}.metadata", "MetadataIndex"),
        (f"{_DCP}.metadata", "StorageMeta"),
        (f"{_DCP}.metadata", "TensorProperties"),
        (f"{_DCP}.metadata", "TensorStorageMetadata"),
        (f"{_DCP}.metadata", "BytesStorageMetadata"),
        (f"{_DCP}.metadata", "ChunkStorageMetadata"),
        (f"{_DCP}.metadata", "_MEM_FORMAT_ENCODING"),
        (f"{_DCP}.filesystem", "_StorageInfo"),
        (f"{_DCP}.filesystem", "_StoragePrefix"),
        (f"{_DCP}.planner", "SavePlan"),
        (f"{_DCP}.planner", "WriteItem"),
        (f"{_DCP}.planner", "WriteItemType"),
        (f"{_DCP}.planner", "TensorWriteData"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
    }
)
# Every torch.save archive (each *.distcp item, rank-state/*.pt, node-local files): a tensor is
# rebuilt from a legacy storage type; a dtype is a global of its own (megatron's sharded
# objects key per-bucket sizes by dtype). Measured: fp32 on CPU (FloatStorage, float32) and the
# RNG states (ByteStorage, LongStorage); the other training precisions' types are listed with
# them (bf16/fp16 params, fp64, the integer and bool buffers).
_DTYPES = ("float32", "bfloat16", "float16", "float64", "int64", "int32", "int8", "uint8", "bool")
_STORAGES = ("Float", "BFloat16", "Half", "Double", "Long", "Int", "Short", "Char", "Byte", "Bool")
TENSORS: frozenset[Global] = frozenset(
    {
        ("torch._utils", "_rebuild_tensor_v2"),
        ("collections", "OrderedDict"),
        *(("torch", dtype) for dtype in _DTYPES),
        *(("torch", f"{kind}Storage") for kind in _STORAGES),
    }
)
# Node-local files (nvrx's LocalCheckpointManager saves megatron's TensorAwareStateDict).
MEGATRON_LOCAL: frozenset[Global] = frozenset(
    {
        ("megatron.core.dist_checkpointing.tensor_aware_state_dict", "MCoreTensorAwareStateDict"),
        ("megatron.core.dist_checkpointing.mapping", "ShardedTensor"),
        ("megatron.core.dist_checkpointing.mapping", "ShardedObject"),
    }
)
# Per megatron-core release (prefixes as pretrain/platform/compat.py's MCORE_0_16 / MCORE_0_19):
# measured identical on 0.16.1 and 0.19.2. megatron's common state (0.16: model/common.pt;
# 0.19: a DCP item) and its sharded objects hold plain values, tensors and dtypes only; 0.19
# writes no common.pt.
CHECKPOINT_GLOBALS: dict[str, frozenset[Global]] = {
    "0.16.": DCP_METADATA | TENSORS | MEGATRON_LOCAL,
    "0.19.": DCP_METADATA | TENSORS | MEGATRON_LOCAL,
}
NEWEST_MEASURED = "0.19."


@functools.cache
def admitted_globals(mcore: str | None = None) -> frozenset[Global]:
    """The allow-list for this megatron-core (or ``mcore``). A release nobody measured gets the
    newest measured list: a file that needs more is refused, loudly, naming the global."""
    if mcore is None:
        try:
            mcore = version("megatron-core")
        except PackageNotFoundError:  # the storage layer's CLI on a box without megatron
            mcore = NEWEST_MEASURED
    prefix = next((p for p in CHECKPOINT_GLOBALS if mcore.startswith(p)), NEWEST_MEASURED)
    return CHECKPOINT_GLOBALS[prefix]


def global_name(module: str, qualname: str) -> str:
    return f"{module}.{qualname}"


def refusal(where: str, name: str) -> str:
    """The one line a refused file gets."""
    return (
        f"checkpoint file {where} needs global {name!r}, which the checkpoint loader does not admit"
    )


class UnsafeCheckpointError(ClassifiedError):
    """A checkpoint file would import a global the loader does not admit, or cannot be read
    far enough to tell; nothing of it was run. The step is unverifiable."""

    kind, exit_code = "checkpoint", exit_codes.CHECKPOINT_IO
