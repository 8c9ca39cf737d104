"""A recipe's real megatron-core model, built rank position by rank position on the meta device.

No memory and no peers: torch's fake process-group backend stands in for the recipe's whole
world (every collective returns at once), megatron-core's parallel state is initialised for the
real layout, and each pipeline stage's GPTModel chunks (one per virtual stage) are built under
``torch.device("meta")``, so 70B parameters cost a few MB of Python objects. What comes out is
what each rank would hold: parameters by kind, which of them are split over TP or EP, and the
output-layer copy of a tied embedding that the last stage keeps.

Shapes do not depend on the TP, CP, EP or DP rank of a stage (megatron pads the vocabulary so
every TP rank holds the same slice), so one rank per pipeline stage is built. Context parallelism
changes no parameter shape either: it is folded into data parallelism here, since megatron-core's
local layer spec (the one that builds without Transformer Engine) refuses CP at construction
(and sequence parallelism, also shape-neutral, is left off for the same reason).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from pretrain.model.gpt import build_chunks, padded_vocab_size, transformer_config
from pretrain.platform.compat import fix_uninitialised_tp_attributes
from recipes import RunConfig
from recipes.config.parallel import ParallelConfig

KINDS = ("embedding", "output", "experts", "dense")


@dataclass
class StageParams:
    """What one rank of pipeline stage ``pp_rank`` holds (all its virtual chunks)."""

    pp_rank: int
    chunks: int  # virtual stages on this rank
    layers: int  # transformer layers on this rank
    local: dict[str, int] = field(default_factory=dict)  # kind -> parameters on this rank
    # kind -> this stage's share of the model's parameters (TP/EP splits undone, a tied
    # output-layer copy left out): summed over stages, the model's total.
    unique: dict[str, int] = field(default_factory=dict)
    expert_local: int = 0  # parameters on this rank that are sharded over expert-DP

    @property
    def local_total(self) -> int:
        return sum(self.local.values())

    @property
    def unique_total(self) -> int:
        return sum(self.unique.values())


def _kind(name: str) -> str:
    if "word_embeddings" in name or "position_embeddings" in name:
        return "embedding"
    if name.startswith("output_layer") or ".output_layer." in name:
        return "output"
    if ".experts." in name:
        return "experts"
    return "dense"


def _count(chunks: list[torch.nn.Module], par: ParallelConfig, pp_rank: int) -> StageParams:
    stage = StageParams(pp_rank, len(chunks), 0, dict.fromkeys(KINDS, 0), dict.fromkeys(KINDS, 0))
    for chunk in chunks:
        stage.layers += len(chunk.decoder.layers)
        for name, param in chunk.named_parameters():
            kind, n = _kind(name), param.numel()
            stage.local[kind] += n
            expert = not getattr(param, "allreduce", True)  # megatron marks expert params
            stage.expert_local += n if expert else 0
            if getattr(param, "shared_embedding", False) and kind == "output":
                continue  # the last stage's copy of a tied embedding: counted on the first
            split = par.tp if getattr(param, "tensor_model_parallel", False) else 1
            stage.unique[kind] += n * split * (par.ep if expert else 1)
    return stage


@contextlib.contextmanager
def fake_world(rank: int, size: int) -> Iterator[None]:
    """The default process group as rank ``rank`` of ``size`` with no peers behind it."""
    # torch's fake backend registers itself on import (test utilities shipped with torch).
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def stage_rank(par: ParallelConfig, size: int, pp_rank: int) -> int:
    """Global rank of (pp_rank, every other coordinate 0) in megatron's tp-cp-ep-dp-pp order."""
    return pp_rank * (size // par.pp)


def build_stage(run: RunConfig, vocab: int, pp_rank: int) -> StageParams:
    """Parameters of one rank of pipeline stage ``pp_rank``, from the real model on meta."""
    # megatron-core: imported after the CPU shim is applied (pretrain/platform/distributed.py)
    from megatron.core import parallel_state as ps

    size, par = run.launch.world_size, run.parallel
    # See the module docstring; the local spec's torch norms also refuse sequence parallelism,
    # which changes no parameter shape either.
    meta_par = dataclasses.replace(par, cp=1, sequence_parallel=False)
    perf = dataclasses.replace(run.perf, fp8=None, tp_comm_overlap=False)  # no TE here
    model = dataclasses.replace(run.model, perform_initialization=False)
    with fake_world(stage_rank(par, size, pp_rank), size):
        ps.initialize_model_parallel(
            tensor_model_parallel_size=par.tp,
            pipeline_model_parallel_size=par.pp,
            virtual_pipeline_model_parallel_size=par.vpp,
            context_parallel_size=1,
            expert_model_parallel_size=par.ep,
            create_gloo_process_groups=False,
        )
        try:
            assert ps.get_pipeline_model_parallel_rank() == pp_rank
            tcfg = transformer_config(model, meta_par, "cpu", False, perf)
            padded = padded_vocab_size(run.model, vocab, par.tp)
            with torch.device("meta"):
                chunks = build_chunks(model, meta_par, tcfg, padded, use_te=False)
            fix_uninitialised_tp_attributes(chunks)  # built uninitialised, as a restore does
            return _count(chunks, par, pp_rank)
        finally:
            ps.destroy_model_parallel()


def build_stages(run: RunConfig, vocab: int) -> list[StageParams]:
    return [build_stage(run, vocab, pp_rank) for pp_rank in range(run.parallel.pp)]


def total_params(stages: list[StageParams]) -> dict[str, int]:
    """kind -> the model's parameters (every shared tensor once)."""
    return {kind: sum(s.unique[kind] for s in stages) for kind in KINDS}


def shape_of(run: RunConfig) -> dict[str, Any]:
    """The layout in one line of numbers, as the report shows it."""
    par, size = run.parallel, run.launch.world_size
    return {
        "world": size,
        "tp": par.tp,
        "pp": par.pp,
        "vpp": par.vpp,
        "cp": par.cp,
        "ep": par.ep,
        "dp": par.data_parallel_size(size),
    }
