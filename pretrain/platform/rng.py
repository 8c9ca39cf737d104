"""Every RNG stream a rank draws from: Python, NumPy, torch (CPU, CUDA) and megatron's tracker.

Captured into checkpoints (resiliency/checkpoint/rank_state.py) so a resumed run draws the same
numbers, and held still around evaluation so validation never moves a training stream.
"""

from __future__ import annotations

import contextlib
import os
import random
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch


def capture_rng(device: str) -> dict[str, Any]:
    # megatron-core: imported after the CPU shim is applied (pretrain/platform/distributed.py)
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "numpy": [
            name,
            torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            int(pos),
            int(has_gauss),
            float(cached),
        ],
        "torch": torch.get_rng_state(),
        "tracker": {k: v.clone() for k, v in get_cuda_rng_tracker().get_states().items()},
    }
    if device == "cuda":
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng(state: dict[str, Any], device: str) -> None:
    # megatron-core: imported after the CPU shim is applied (pretrain/platform/distributed.py)
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if device == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


def reseed_rng(seed: int, step: int, rank: int) -> int:
    """Deterministic fresh streams after a topology change (old per-rank states don't map)."""
    # megatron-core: imported after the CPU shim is applied (pretrain/platform/distributed.py)
    from megatron.core import tensor_parallel

    derived = (seed * 1_000_003 + step * 1_009 + rank) % (2**31 - 1)
    random.seed(derived)
    np.random.seed(derived)
    torch.manual_seed(derived)
    tensor_parallel.model_parallel_cuda_manual_seed(derived)
    return derived


@contextlib.contextmanager
def preserved_rng(device: str) -> Iterator[None]:
    """Whatever runs inside leaves every RNG stream as it found it."""
    state = capture_rng(device)
    try:
        yield
    finally:
        restore_rng(state, device)


# What train.deterministic sets, unless the environment already says otherwise: cuBLAS's
# reproducible workspace (it must be set before the first GEMM) and one NCCL algorithm (set
# before the first collective), as Megatron-LM's --deterministic-mode asks.
DETERMINISTIC_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NCCL_ALGO": "Ring"}


def make_deterministic() -> dict[str, str]:
    """Bitwise-reproducible kernels from here on (before CUDA and the process group start).

    warn_only: an op with no deterministic kernel warns with its name instead of failing the
    run, so a report can say which kernel broke reproducibility. Returns the env it set."""
    set_here = {k: v for k, v in DETERMINISTIC_ENV.items() if k not in os.environ}
    os.environ.update(set_here)
    torch.use_deterministic_algorithms(True, warn_only=True)
    # logs.setup_logging hides UserWarnings at INFO; this one names the offending kernel.
    warnings.filterwarnings("default", message=".*deterministic implementation.*")
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    # torch.compile'd code (megatron's jit_fuser) draws random numbers as eager code does, so
    # a compiled dropout gives eager's masks whichever process compiled it and when.
    import torch._inductor.config as inductor_config

    inductor_config.fallback_random = True
    return set_here
