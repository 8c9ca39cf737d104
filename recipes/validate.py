"""Checks that need the launch environment: world size and device. Run before any process group."""

from __future__ import annotations

import dataclasses
import secrets
import time

from recipes.checks import ConfigError
from recipes.config.run import RunConfig


def resolve_device(requested: str, cuda_available: bool) -> str:
    if requested == "cuda" and not cuda_available:
        raise ConfigError("train.device=cuda but no CUDA device is visible; use train.device=auto")
    if requested == "auto":
        return "cuda" if cuda_available else "cpu"
    return requested


def transformer_engine_needs(run: RunConfig) -> list[str]:
    """The settings of ``run`` that only Transformer Engine implements (its layer spec, which
    the trainer picks on a GPU where TE imports): context parallelism (megatron-core's local
    DotProductAttention asserts CP=1), FP8 and TP communication overlap. Empty: megatron-core's
    local spec runs the model without TE."""
    found = [f"parallel.cp={run.parallel.cp}"] if run.parallel.cp > 1 else []
    return found + run.perf.needs_cuda


def validate_runtime(run: RunConfig, world_size: int, device: str) -> int:
    """Validate ``run`` for ``world_size`` ranks on ``device``; returns the data-parallel size."""
    par, train = run.parallel, run.train
    if par.cp > 1 and device != "cuda":
        raise ConfigError(
            f"parallel.cp={par.cp} needs CUDA: context parallelism in megatron-core is implemented "
            "only by Transformer Engine's TEDotProductAttention. Use parallel.cp=1 on CPU."
        )
    if run.perf.needs_cuda and device != "cuda":
        raise ConfigError(
            f"{', '.join(run.perf.needs_cuda)} needs Transformer Engine on a CUDA GPU; on "
            "CPU leave perf.fp8=null and perf.tp_comm_overlap=false"
        )
    if train.precision == "bf16" and device != "cuda":
        raise ConfigError("train.precision=bf16 is supported on CUDA only; use fp32 or auto on CPU")
    dp = par.data_parallel_size(world_size)
    per_step = train.micro_batch_size * dp
    if train.global_batch_size % per_step:
        raise ConfigError(
            f"train.global_batch_size={train.global_batch_size} must be a multiple of "
            f"train.micro_batch_size*dp = {train.micro_batch_size}*{dp} = {per_step}"
        )
    return dp


def num_microbatches(run: RunConfig, dp: int) -> int:
    return run.train.global_batch_size // (run.train.micro_batch_size * dp)


# torchrun's --rdzv-id default: not an id of this launch.
_NO_LAUNCH_ID = ("", "none")


def resolve_run_id(run: RunConfig, launch_id: str | None, world_size: int) -> RunConfig:
    """``run`` with its run_id set: as given, or a new run's name ``<model>-<launch id>``.

    ``launch_id`` names this launch and must be the same on every rank and every in-place
    restart of it (torchrun's TORCHELASTIC_RUN_ID: a fresh uuid per ``--standalone`` launch, or
    the ``--rdzv-id`` the user chose); a launcher that pins the config passes a timestamp. A
    single process without one gets a timestamp; several ranks without one cannot agree on a
    name, so they must be given a run_id.
    """
    if run.run_id is not None:
        return run
    if launch_id in _NO_LAUNCH_ID or launch_id is None:
        if world_size > 1:
            raise ConfigError(
                "run_id is not set and this launch has no id to name a new run by (torchrun "
                "--rdzv-id or --standalone); set run_id=<name> (the same name continues a run)"
            )
        launch_id = new_launch_id()
    name = f"{run.model.name}-{launch_id[:8] if _is_uuid(launch_id) else launch_id}"
    return dataclasses.replace(run, run_id=name)


def new_launch_id() -> str:
    """A launcher's id for a launch it pins: sortable, and unique on one machine."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


def _is_uuid(value: str) -> bool:
    return len(value) == 36 and value.count("-") == 4
