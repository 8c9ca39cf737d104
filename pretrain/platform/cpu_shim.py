"""Device shim: redirect megatron-core's hard CUDA calls to CPU so it trains on gloo.

Applied only when no CUDA device is present. Every patch is one named entry with a one-line
reason and the megatron-core releases it is needed on (``Patch.affected``, version prefixes as
in pretrain/platform/compat.py); ``MCORE_RECIPES_SHIM_SKIP=name,name`` leaves patches out so the
test suite can prove each one is still needed where applied (training fails without it), not applied
elsewhere, and still works (training passes with all).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.cuda.random as cuda_random
from torch.overrides import TorchFunctionMode

from pretrain.platform.compat import MCORE_0_16, MCORE_0_19, mcore_version, nvrx_straggler

log = logging.getLogger(__name__)

SKIP_ENV = "MCORE_RECIPES_SHIM_SKIP"


@dataclass(frozen=True)
class Patch:
    name: str
    reason: str
    apply: Callable[[], None]
    affected: tuple[str, ...] = (MCORE_0_16, MCORE_0_19)  # megatron-core releases that need it


class _NullStream:
    """Stands in for torch.cuda.Stream/Event: CPU work is already ordered."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_event(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, *args: Any, **kwargs: Any) -> "_NullStream":
        return _NullStream()

    def record(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait(self, *args: Any, **kwargs: Any) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: Any) -> float:
        return 0.0


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaToCpuMode(TorchFunctionMode):
    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = {**kwargs, "device": "cpu"}
        if (
            func is torch.Tensor.to
            and len(args) > 1
            and _is_cuda_device(args[1])
            and not isinstance(args[1], int)
        ):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


_MODE = _CudaToCpuMode()


def _patch_current_device() -> None:
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]


def _patch_rng() -> None:
    # megatron-core: imported after the CPU shim is applied (pretrain/platform/distributed.py)
    import megatron.core.tensor_parallel.random as mcore_random

    # New function objects per module: torch.compile's rule map (built on a host where CUDA
    # is present, e.g. --plan on a GPU node) refuses one object under two names with
    # different rules, which `torch.cuda.manual_seed = torch.manual_seed` was (torch 2.11).
    for module in (torch.cuda, cuda_random):
        module.get_rng_state = _cpu_get_rng_state()  # type: ignore[assignment]
        module.set_rng_state = _cpu_set_rng_state()  # type: ignore[assignment]
        # Seeds the CPU generator: the tracker saves/restores around it, so streams stay apart.
        module.manual_seed = _cpu_manual_seed()  # type: ignore[assignment]
    mcore_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mcore_random._set_cuda_rng_state = _cpu_set_rng_state()


def _cpu_get_rng_state() -> Any:
    def get_rng_state(device: Any = "cpu") -> torch.Tensor:
        return torch.get_rng_state()

    return get_rng_state


def _cpu_set_rng_state() -> Any:
    def set_rng_state(state: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        torch.set_rng_state(state)

    return set_rng_state


def _cpu_manual_seed() -> Any:
    def manual_seed(seed: int) -> Any:
        return torch.manual_seed(seed)

    return manual_seed


def _patch_sync_and_streams() -> None:
    torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]
    torch.cuda.Stream = _NullStream  # type: ignore[assignment,misc]
    torch.cuda.Event = _NullStream  # type: ignore[assignment,misc]
    torch.cuda.current_stream = lambda device=None: _NullStream()  # type: ignore[assignment]
    torch.cuda.default_stream = lambda device=None: _NullStream()  # type: ignore[assignment]
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()  # type: ignore[assignment]
    torch.cuda.empty_cache = lambda: None  # type: ignore[assignment]


def _patch_device_kwargs() -> None:
    _MODE.__enter__()  # stays active for the whole process


def _patch_tensor_type() -> None:
    original = torch.Tensor.type

    def cuda_type(
        self: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kw: Any
    ) -> Any:
        if dtype is None and not kw:
            name = original(self)
            return name.replace("torch.", "torch.cuda.", 1) if ".cuda." not in name else name
        return original(self, dtype, non_blocking, **kw)

    torch.Tensor.type = cuda_type  # type: ignore[method-assign]


def _patch_moe_te_names() -> None:
    # megatron-core: imported after the CPU shim is applied (pretrain/platform/distributed.py)
    import megatron.core.transformer.moe.moe_utils as moe_utils

    for name in (
        "te_general_gemm",
        "fused_compute_score_for_moe_aux_loss",
        "fused_moe_aux_loss",
        "fused_permute",
        "fused_permute_with_probs",
        "fused_sort_chunks_by_index",
        "fused_sort_chunks_by_index_with_probs",
        "fused_topk_with_score_function",
        "fused_unpermute",
    ):
        if not hasattr(moe_utils, name):
            setattr(moe_utils, name, None)


def _patch_moe_split_sizes() -> None:
    # megatron-core: imported after the CPU shim is applied (pretrain/platform/distributed.py)
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.moe.token_dispatcher as dispatcher

    def to_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        return tensor.numpy() if torch.is_tensor(tensor) and as_numpy else tensor

    moe_utils.maybe_move_tensor_to_cpu = to_host
    dispatcher.maybe_move_tensor_to_cpu = to_host


PATCHES: tuple[Patch, ...] = (
    Patch(
        "current_device",
        "mcore allocates on torch.cuda.current_device(); make that 'cpu'",
        _patch_current_device,
    ),
    Patch(
        "rng",
        "mcore's RNG tracker forks CUDA generators; fork the CPU generator instead",
        _patch_rng,
    ),
    Patch(
        "sync_and_streams",
        "synchronize/Stream/Event raise without CUDA; CPU work is ordered",
        _patch_sync_and_streams,
    ),
    Patch(
        "device_kwargs",
        "optimizer, clip_grads and schedules hard-code device='cuda'/.cuda()",
        _patch_device_kwargs,
    ),
    Patch(
        "tensor_type",
        "distrib_optimizer/clip_grads accept only param.type()=='torch.cuda.*'",
        _patch_tensor_type,
    ),
    # 0.19 tests HAVE_TE before each fused-op name (measured: MoE trains without this patch).
    Patch(
        "moe_te_names",
        "moe_utils names TE fused ops only when TE imports -> NameError",
        _patch_moe_te_names,
        affected=(MCORE_0_16,),
    ),
    Patch(
        "moe_split_sizes",
        "alltoall split sizes become lists only for CUDA tensors",
        _patch_moe_split_sizes,
    ),
)

_applied: list[str] = []


def skipped() -> set[str]:
    return {n for n in os.environ.get(SKIP_ENV, "").split(",") if n}


def needed(mcore: str | None = None) -> list[str]:
    """The patches this megatron-core release needs on CPU."""
    mcore = mcore or mcore_version()
    return [p.name for p in PATCHES if mcore.startswith(p.affected)]


def apply() -> list[str]:
    """Apply, once, each needed patch not in MCORE_RECIPES_SHIM_SKIP. Returns applied names."""
    if _applied:
        return list(_applied)
    unknown = skipped() - {p.name for p in PATCHES}
    if unknown:
        raise ValueError(f"{SKIP_ENV} names unknown patches {sorted(unknown)}")
    wanted = needed()
    for patch in PATCHES:
        if patch.name in wanted and patch.name not in skipped():
            patch.apply()
            _applied.append(patch.name)
    return list(_applied)


# ---------------------------------------------------------------- nvidia-resiliency-ext on CPU
# Make nvrx's straggler ``Detector`` run without CUDA (the only place that does).
# Make nvidia-resiliency-ext's straggler ``Detector`` run without CUDA (the only place that does).
#
# Two things stand in its way on a CPU box:
#
# * ``straggler.cupti`` imports ``nvrx_cupti_module``, a C++ extension linked against
#   ``libcupti.so.12``; without the CUDA toolkit the import fails, and ``Detector.initialize``
#   with it. A no-op profiler keeps section timing alive; kernel statistics stay empty, so the GPU
#   scores are NaN, as they should be.
# * Section timing reads ``time.perf_counter_ns``: wall time. In synchronous training a slow rank
#   makes every peer wait for it inside collectives, so all ranks' steps take the same wall time
#   and the straggler is invisible. On a GPU the kernel timings (CUPTI) carry the signal; on CPU
#   the analogue is the process's CPU time, which a rank blocked in a gloo collective does not
#   accumulate (measured: ~0 s CPU over a 2 s wait). The section clock of the straggler module
#   alone is switched to CPU time.
#
# ``torch.cuda.synchronize`` (called by ``generate_report``) is already a no-op under the shim.
CUPTI_MODULE = "nvrx_cupti_module"


class NullCuptiProfiler:
    """Same interface as nvrx_cupti_module.CuptiProfiler; records nothing."""

    def __init__(self, **kwargs: Any) -> None:
        pass

    def initialize(self) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def get_stats(self) -> dict:
        return {}

    def reset(self) -> None:
        pass


def _cpu_clock() -> types.SimpleNamespace:
    return types.SimpleNamespace(
        perf_counter_ns=time.process_time_ns, monotonic=time.monotonic, time=time.time
    )


def install_cupti_stub() -> None:
    """Register the no-op profiler unless the real extension loads (idempotent)."""
    if CUPTI_MODULE in sys.modules:
        return
    try:
        __import__(CUPTI_MODULE)
        return
    except ImportError as exc:
        log.debug("straggler: %s unavailable (%s); CUDA kernel scores disabled", CUPTI_MODULE, exc)
    module = types.ModuleType(CUPTI_MODULE)
    module.CuptiProfiler = NullCuptiProfiler  # type: ignore[attr-defined]
    sys.modules[CUPTI_MODULE] = module


def nvrx_straggler_on_cpu(device: str) -> None:
    """Prepare nvrx's straggler package for ``device`` ("cpu" patches; "cuda" leaves it alone)."""
    if device == "cuda":
        return
    install_cupti_stub()
    detector_module = nvrx_straggler("straggler")

    detector_module.time = _cpu_clock()  # type: ignore[attr-defined]
