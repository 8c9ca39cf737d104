"""``python -m pretrain recipe=<name> --plan [--gpu NAME|GiB] [--json]``: will the recipe fit?

Builds the recipe's real model on the meta device at its real layout
(:mod:`pretrain.fit.meta_model`), then reports parameters per rank and in total, memory per GPU
(:mod:`pretrain.fit.memory`), whether the busiest rank fits the GPU with the headroom left, and if
not the smallest change that would; and the checkpoint's size per version and per rank, with the
``resiliency capacity`` command that turns it into a save interval and storage. Runs on a CPU in
seconds.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pretrain.data.tokenizer import build_tokenizer
from pretrain.data.vocab import padded_vocab_size
from pretrain.fit.memory import (
    DEFAULT_HEADROOM,
    GIB,
    StageMemory,
    gpu_bytes,
    stage_memory,
)
from pretrain.fit.meta_model import KINDS, StageParams, build_stages, shape_of, total_params
from pretrain.fit.timing import (
    checkpoint_bytes,
    progress_problems,
    resolve_save_interval,
    time_plan,
)
from pretrain.platform import cpu_shim
from recipes import ConfigError, RunConfig, load_config
from recipes.gpus import find_gpu

log = logging.getLogger(__name__)


@dataclass
class Plan:
    run: RunConfig
    overrides: list[str]
    gpu: str
    usable: float  # bytes a rank may use: the GPU's, less the headroom
    vocab: int
    padded_vocab: int
    stages: list[StageParams]
    memory: list[StageMemory]
    fix: str | None = None  # the smallest change that fits, when this does not

    @property
    def totals(self) -> dict[str, int]:
        return total_params(self.stages)

    @property
    def total(self) -> int:
        return sum(self.totals.values())

    @property
    def unpadded_total(self) -> int:
        """The published count: the vocabulary's padding rows left out."""
        rows = self.padded_vocab - self.vocab
        tables = 1 if self.run.model.share_embeddings_and_output_weights else 2
        return self.total - rows * self.run.model.hidden_size * tables

    @property
    def peak(self) -> StageMemory:
        return max(self.memory, key=lambda m: m.total)

    @property
    def fits(self) -> bool:
        return self.peak.total <= self.usable

    @property
    def checkpoint_bytes(self) -> int:
        return checkpoint_bytes(self.run, self.total)


def vocab_size(run: RunConfig, vocab: int | None) -> int:
    """``--vocab``, or the recipe's tokenizer (local files); ConfigError naming what to give."""
    if vocab is not None:
        return vocab
    if run.data.vocab_size is not None:
        return run.data.vocab_size
    try:
        return build_tokenizer(run.data.tokenizer, run.data.tokenizer_path).vocab_size
    except (ValueError, OSError, ImportError) as exc:
        raise ConfigError(
            f"the vocabulary size is needed: the recipe's tokenizer "
            f"({run.data.tokenizer_path or run.data.tokenizer}) is not here ({exc}); give "
            "--vocab N (e.g. 128256 for Llama 3, 32000 for Mixtral)"
        ) from None


def estimate(run: RunConfig, vocab: int) -> tuple[list[StageParams], list[StageMemory]]:
    run.parallel.data_parallel_size(run.launch.world_size)  # the layout divides, or ConfigError
    padded = padded_vocab_size(run.model, vocab, run.parallel.tp)
    stages = build_stages(run, vocab)
    return stages, [stage_memory(run, s, padded) for s in stages]


def candidates(run: RunConfig) -> list[tuple[str, RunConfig]]:
    """Single changes that lower the busiest rank's memory, cheapest to training speed first."""
    out: list[tuple[str, RunConfig]] = []
    par, model = run.parallel, run.model
    if run.perf.recompute != "full":
        perf = dataclasses.replace(run.perf, recompute="full")
        out.append(("perf.recompute=full", dataclasses.replace(run, perf=perf)))
    mbs = run.train.micro_batch_size
    if mbs > 1:
        train = dataclasses.replace(run.train, micro_batch_size=mbs // 2)
        out.append((f"train.micro_batch_size={mbs // 2}", dataclasses.replace(run, train=train)))
    groups = model.num_query_groups or model.num_attention_heads
    tp = par.tp * 2
    if tp <= run.launch.nproc_per_node and groups % tp == 0:
        out.append((f"parallel.tp={tp}", _with_parallel(run, tp=tp, sequence_parallel=True)))
    pp = par.pp * 2
    if model.num_layers % (pp * (par.vpp or 1)) == 0:
        out.append((f"parallel.pp={pp}", _with_parallel(run, pp=pp)))
    return out


def _with_parallel(run: RunConfig, **changes: Any) -> RunConfig:
    return dataclasses.replace(run, parallel=dataclasses.replace(run.parallel, **changes))


def smallest_fix(run: RunConfig, vocab: int, usable: float) -> str | None:
    for change, candidate in candidates(run):
        try:
            _, memory = estimate(candidate, vocab)
        except ConfigError:
            continue  # the layout does not divide the world: not an option
        if max(m.total for m in memory) <= usable:
            return change
    return None


def make_plan(
    overrides: Sequence[str],
    gpu: str | None = None,
    vocab: int | None = None,
    headroom: float = DEFAULT_HEADROOM,
) -> Plan:
    """``gpu``: None plans for the recipe's ``launch.gpu``."""
    run = load_config(list(overrides))  # names, the GPU and the vocabulary: before the model
    gpu = gpu or run.launch.gpu
    usable = gpu_bytes(gpu) * (1 - headroom)
    size = vocab_size(run, vocab)
    cpu_shim.apply()  # megatron-core builds on this host's CPU
    stages, memory = estimate(run, size)
    padded = padded_vocab_size(run.model, size, run.parallel.tp)
    plan = Plan(run, list(overrides), gpu, usable, size, padded, stages, memory)
    if not plan.fits:
        plan.fix = smallest_fix(run, size, usable)
    return plan


def _b(n: float) -> str:
    return f"{n / 1e9:.3f} B" if n >= 1e7 else f"{n / 1e6:.2f} M"


def _g(n: float) -> str:
    return f"{n / GIB:.1f}" if n >= 0.1 * GIB else f"{n / GIB:.3f}"


def _size(n: float) -> str:
    return f"{n / GIB:.1f} GiB" if n >= 0.1 * GIB else f"{n / (1 << 20):.1f} MiB"


def report(plan: Plan) -> str:
    run, shape = plan.run, shape_of(plan.run)
    totals = plan.totals
    layout = " ".join(f"{k.upper()}={v}" for k, v in shape.items() if k != "world" and v)
    lines = [
        f"plan: {run.model.name} on {shape['world']} GPUs ({run.launch.nodes} node(s) x "
        f"{run.launch.nproc_per_node}), {layout}, "
        f"{'fp32' if run.train.precision == 'fp32' else 'bf16'} weights, "
        f"micro-batch {run.train.micro_batch_size}, global batch {run.train.global_batch_size}",
        f"parameters: {_b(plan.total)} (published convention, vocabulary padding left out: "
        f"{_b(plan.unpadded_total)}): "
        + ", ".join(f"{kind} {_b(totals[kind])}" for kind in KINDS)
        + f"; vocabulary {plan.vocab} padded to {plan.padded_vocab}",
        "per GPU (every TP/CP/EP/DP rank of a stage holds the same), GiB:",
        "  stage  chunks  layers  parameters  weights  grads  optimizer  activations  total",
    ]
    for stage, mem in zip(plan.stages, plan.memory):
        lines.append(
            f"  {stage.pp_rank:>5}  {stage.chunks:>6}  {stage.layers:>6}  "
            f"{_b(stage.local_total):>10}  {_g(mem.weights):>7}  {_g(mem.grads):>5}  "
            f"{_g(mem.optimizer):>9}  {_g(mem.activations):>11}  {_g(mem.total):>5}"
        )
    lines.append(_verdict(plan))
    lines.extend(_checkpoint_lines(plan))
    return "\n".join(lines)


def _verdict(plan: Plan) -> str:
    peak = plan.peak
    room = f"{_g(plan.usable)} GiB usable of {plan.gpu} after {DEFAULT_HEADROOM:.0%} headroom"
    busiest = f"stage {peak.pp_rank} needs {_g(peak.total)} GiB (incl. 2 GiB runtime)"
    if plan.fits:
        return f"fits: yes, {busiest} of {room}"
    fix = f"; smallest change that fits: {plan.fix}" if plan.fix else "; no single change fits"
    return f"fits: NO, {busiest} of {room}{fix}"


def _checkpoint_lines(plan: Plan) -> list[str]:
    size, world = plan.checkpoint_bytes, plan.run.launch.world_size
    keep = plan.run.checkpoint.keep_last
    command = [
        "python -m resiliency capacity",
        *plan.overrides,
        f"--params {plan.total}",
        *([f"--gpu {plan.gpu}"] if find_gpu(plan.gpu) else []),
    ]
    return [
        f"checkpoint: {_size(size)} ({size / 1e9:.2f} GB) per version ({_size(size * keep)} "
        f"with keep_last={keep}), {_size(size / world)} per rank written and, with async "
        "saves, staged in host memory",
        *_time_lines(plan),
        "save interval and storage: " + " ".join(command),
    ]


def _time_lines(plan: Plan) -> list[str]:
    """Step and save time, the auto interval and the Slurm progress check, as a launch would
    judge them (pretrain/fit/timing.py)."""
    run = dataclasses.replace(plan.run, launch=dataclasses.replace(plan.run.launch, gpu=plan.gpu))
    times = time_plan(run)
    if times is None:
        return ["time: no step time to plan with (set train.step_time_s)"]
    slurm = run.launch.slurm
    resolved = resolve_save_interval(run, slurm.time_limit_s)
    interval = resolved.checkpoint.save_interval
    lines = [
        f"time: step {times.step_s:.3g} s ({times.step_detail}); save {times.save_s:.0f} s at "
        f"checkpoint.plan_bandwidth={run.checkpoint.plan_bandwidth:g} GB/s; Young's interval "
        f"{times.young_steps} steps; checkpoint.save_interval={run.checkpoint.save_interval}"
        + (f" -> {interval} on Slurm" if run.checkpoint.save_interval == "auto" else ""),
    ]
    problems = progress_problems(resolved, slurm.time_limit_s, slurm.signal_grace_s)
    verdict = "; ".join(problems) if problems else "ok"
    lines.append(
        f"progress on Slurm (time limit {slurm.time_limit}, grace {slurm.signal_grace_s} s): "
        f"{verdict}"
    )
    return lines


def as_json(plan: Plan) -> str:
    return json.dumps(
        {
            "gpu": plan.gpu,
            "usable_bytes": plan.usable,
            "fits": plan.fits,
            "fix": plan.fix,
            "total_params": plan.total,
            "published_params": plan.unpadded_total,
            "params_by_kind": plan.totals,
            "stages": [dataclasses.asdict(s) for s in plan.stages],
            "memory": [dataclasses.asdict(m) | {"total": m.total} for m in plan.memory],
            "checkpoint_bytes": plan.checkpoint_bytes,
        }
    )
