"""The GPUs the planners know: one table for the fit check (memory), the step-time estimate
(dense peak TFLOP/s) and every flag or key that names a GPU.

A GPU is named by its model (``H100``, as ``resiliency capacity --gpu`` and the soak take it)
or by model and memory (``h100-80gb``, as ``launch.gpu`` and ``--plan --gpu`` take it), in any
case; a bare model means its memory variant listed first. Memory is what a process can
allocate as nvidia-smi reports it (MiB); peaks are vendor datasheet figures for SXM parts,
dense (without sparsity).
"""

from __future__ import annotations

from dataclasses import dataclass

from recipes.checks import ConfigError


@dataclass(frozen=True)
class GpuSpec:
    name: str  # model-memory, as launch.gpu takes it
    model: str  # the model alone, as it appears in torch.cuda.get_device_name()
    memory_mib: int
    peak_tflops: dict[str, float]  # precision (bf16 | fp8) -> dense peak per device


GPUS: tuple[GpuSpec, ...] = (
    GpuSpec("h100-80gb", "H100", 81559, {"bf16": 989.0, "fp8": 1979.0}),
    GpuSpec("h200-141gb", "H200", 143771, {"bf16": 989.0, "fp8": 1979.0}),
    GpuSpec("a100-80gb", "A100", 81920, {"bf16": 312.0}),
    GpuSpec("a100-40gb", "A100", 40960, {"bf16": 312.0}),
)
GPU_NAMES = tuple(g.name for g in GPUS)


def known_gpus() -> str:
    models = sorted({g.model for g in GPUS})
    return f"{', '.join(GPU_NAMES)} (or the model alone: {', '.join(models)})"


def find_gpu(name: str) -> GpuSpec | None:
    """The spec named ``name`` (``h100-80gb``, ``H100``, ``h100``), None when unknown."""
    wanted = name.strip().lower()
    for gpu in GPUS:
        if wanted in (gpu.name, gpu.model.lower()):
            return gpu
    return None


def lookup_gpu(name: str, what: str = "--gpu") -> GpuSpec:
    gpu = find_gpu(name)
    if gpu is None:
        raise ConfigError(
            f"{what}={name!r}: not a GPU the planner knows; give one of {known_gpus()}"
        )
    return gpu


def device_peak_tflops(device_name: str, precision: str) -> float | None:
    """The dense peak of a device as torch names it ("NVIDIA H100 80GB HBM3"), None when
    unknown (a CPU, a model not in the table, a precision it has no peak for)."""
    for gpu in GPUS:
        if gpu.model in device_name.upper():
            return gpu.peak_tflops.get(precision)
    return None


def gpu_bytes(gpu: str) -> int:
    """Bytes of a named GPU, or of ``<GiB>`` given as a number; ConfigError otherwise."""
    spec = find_gpu(gpu)
    if spec is not None:
        return spec.memory_mib << 20
    try:
        return int(float(gpu) * (1 << 30))
    except ValueError:
        raise ConfigError(
            f"--gpu {gpu!r}: give one of {known_gpus()}, or the memory in GiB"
        ) from None
