"""How long a step and a save take, how often to save, and whether a job of a given length
makes progress: the planners' time formulas, in one place (``--plan``, ``resiliency
capacity``, ``checkpoint.save_interval=auto`` and the launchers' progress check use them).

- Step time: ``train.step_time_s`` when measured, else Megatron-LM's model FLOPs per step
  (pretrain/model/flops.py) over world size x the dense peak of ``launch.gpu`` x an assumed MFU.
- Save time: one checkpoint version (pretrain/fit/memory.py) at ``checkpoint.plan_bandwidth``.
- Interval: Young's approximation sqrt(2 x save time x MTBF) (section 16 of the fault-tolerance
  notes), the job's MTBF being ``checkpoint.plan_gpu_mtbf_h`` over its GPU count.
- Progress: a job must live at least two save intervals (else a requeue can start from the
  same step as the one before), its saves must not take longer than the steps between them
  (else they queue and training waits on them), an interval of one step is no interval (a time
  limit that squeezes ``auto`` down to it is too short), and its signal grace must cover the
  step in flight plus an emergency save.

Everything here is arithmetic on the config: no torch, no model, milliseconds.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from pretrain.data.vocab import padded_vocab_size
from pretrain.model.flops import flops_per_step
from recipes import ConfigError, RunConfig
from recipes.config.model import ModelConfig
from recipes.gpus import GPUS, find_gpu, known_gpus

DEFAULT_MFU = 0.40  # what large Megatron-LM pretraining runs report on H100 (35-45 %)
# A job's start before its first step (imports, rendezvous, model build, restore read): an
# allowance for the progress check, not a measurement (bench P3 measures the tiny job's).
START_ALLOWANCE_S = 300.0
# Saves shorter than this are not judged against the steps between them: the estimates leave
# out the fixed costs of a step and of a save, which dominate a toy model's (gpt_tiny on GPUs
# is estimated at 20 us per step and 3 ms per save).
JUDGED_SAVE_S = 1.0


@dataclass(frozen=True)
class StepTime:
    seconds: float | None  # None: not enough to estimate it
    detail: str  # where it came from, or what is missing


def model_parameters(model: ModelConfig, padded_vocab: int) -> int:
    """Parameters of megatron-core's GPTModel for ``model`` (all ranks together), from the
    config alone: embeddings, per layer two norms, QKV (with GQA) and output projections, the
    MLP (SwiGLU's extra matrix, or a router plus every expert of an MoE layer), the final norm
    and an untied output layer."""
    h, heads = model.hidden_size, model.num_attention_heads
    groups = model.num_query_groups or heads
    kv = h // heads
    bias = model.add_bias_linear
    norm = 2 * h if model.normalization == "LayerNorm" else h  # LayerNorm has a bias
    qkv = kv * (heads + 2 * groups)
    attention = h * qkv + heads * kv * h + ((qkv + h) if bias else 0)
    glu = 2 if model.activation == "swiglu" else 1  # SwiGLU: gate and up in one fc1

    def mlp(ffn: int) -> int:
        return h * ffn * glu + ffn * h + ((ffn * glu + h) if bias else 0)

    ffn = model.ffn_hidden_size or 4 * h
    if model.num_experts:
        expert_ffn = model.moe_ffn_hidden_size or ffn
        mlp_params = h * model.num_experts + model.num_experts * mlp(expert_ffn)  # + router
    else:
        mlp_params = mlp(ffn)
    embedding = padded_vocab * h
    if model.position_embedding_type == "learned_absolute":
        embedding += (model.max_position_embeddings or model.seq_length) * h
    output = 0 if model.share_embeddings_and_output_weights else padded_vocab * h
    return embedding + model.num_layers * (2 * norm + attention + mlp_params) + norm + output


def recipe_padded_vocab(run: RunConfig) -> int | None:
    """The padded vocabulary a recipe declares (model.padded_vocab_size or data.vocab_size),
    None when only its tokenizer files would say."""
    if run.model.padded_vocab_size is not None:
        return run.model.padded_vocab_size
    if run.data.vocab_size is not None:
        return padded_vocab_size(run.model, run.data.vocab_size, run.parallel.tp)
    return None


def step_time(
    run: RunConfig,
    padded_vocab: int | None,
    gpu: str | None = None,
    peak: float | None = None,
    mfu: float = DEFAULT_MFU,
) -> StepTime:
    """``train.step_time_s``, or FLOPs per step / (world size x peak x MFU); says what is
    missing when it cannot. ``gpu`` (default ``launch.gpu``) names the peak's GPU."""
    if run.train.step_time_s is not None:
        return StepTime(run.train.step_time_s, "train.step_time_s")
    precision = "fp8" if run.perf.fp8 else "bf16"
    peak = peak or run.train.peak_tflops
    if peak is None and gpu is None and run.launch.gpus_per_node == 0:
        known = ", ".join(sorted({g.model for g in GPUS}))
        return StepTime(
            None, f"a CPU run: give train.step_time_s (--step-time), or --gpu ({known})"
        )
    if peak is None:
        name = gpu or run.launch.gpu
        spec = find_gpu(name)
        if spec is None:
            return StepTime(None, f"no GPU named {name!r} (known: {known_gpus()})")
        peak = spec.peak_tflops.get(precision)
        if peak is None:
            return StepTime(None, f"no {precision} peak known for {spec.name}")
    if padded_vocab is None:
        return StepTime(None, "the vocabulary size is unknown (set data.vocab_size)")
    gbs, world = run.train.global_batch_size, run.launch.world_size
    flops = flops_per_step(run.model, gbs, padded_vocab)
    seconds = flops / (world * peak * 1e12 * mfu)
    return StepTime(
        seconds,
        f"estimated: {flops:.3g} FLOPs/step (global batch {gbs}) / ({world} GPUs x "
        f"{peak:g} TFLOP/s {precision} x {mfu:.0%} MFU, assumed)",
    )


# What one checkpoint version holds per parameter. megatron's distributed optimizer saves its
# fp32 main params even when the weights are fp32 (both optimizer formats): fp32 costs 16 B.
WEIGHT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
MAIN_PARAM_BYTES = 4
MOMENT_BYTES = 4  # per optimizer moment (Adam keeps two, SGD one), fp32


def checkpoint_bytes_per_param(dtype: str = "bf16", moments: int = 2) -> int:
    """Weights in ``dtype`` + the fp32 main params + ``moments`` fp32 optimizer moments."""
    return WEIGHT_BYTES[dtype] + MAIN_PARAM_BYTES + MOMENT_BYTES * moments


def checkpoint_bytes(run: RunConfig, total_params: int) -> int:
    """One checkpoint version of ``total_params`` parameters (all ranks together), Adam."""
    dtype = "fp32" if run.train.precision == "fp32" else "bf16"  # "auto": bf16 on a GPU
    return total_params * checkpoint_bytes_per_param(dtype)


def save_seconds(run: RunConfig, total_params: int) -> float:
    """One checkpoint version written at ``checkpoint.plan_bandwidth`` (GB/s)."""
    return checkpoint_bytes(run, total_params) / (run.checkpoint.plan_bandwidth * 1e9)


def job_mtbf_s(run: RunConfig) -> float:
    """The job's mean time between failures: one GPU's over the GPUs (ranks) it runs on."""
    return run.checkpoint.plan_gpu_mtbf_h * 3600 / run.launch.world_size


def young_interval_s(save_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum: sqrt(2 x save time x MTBF)."""
    return math.sqrt(2 * save_s * mtbf_s)


@dataclass(frozen=True)
class TimePlan:
    """What the auto interval and the progress check are computed from, with the sources."""

    step_s: float
    step_detail: str
    save_s: float
    mtbf_s: float

    @property
    def young_steps(self) -> int:
        return max(1, round(young_interval_s(self.save_s, self.mtbf_s) / self.step_s))


def time_plan(run: RunConfig) -> TimePlan | None:
    """The recipe's step and save times, None when its step time cannot be known (a CPU
    recipe without train.step_time_s, an unknown vocabulary)."""
    padded = recipe_padded_vocab(run)
    step = step_time(run, padded)
    if step.seconds is None or padded is None:
        return None
    params = model_parameters(run.model, padded)
    return TimePlan(step.seconds, step.detail, save_seconds(run, params), job_mtbf_s(run))


def resolve_save_interval(run: RunConfig, time_limit_s: float | None = None) -> RunConfig:
    """``checkpoint.save_interval=auto`` replaced by Young's interval in steps, lowered where a
    job of ``time_limit_s`` (a Slurm job's --time) would not fit two of them; any other value
    as is; None when checkpointing is off (nothing to space out). ConfigError naming what to
    give when the step time cannot be known."""
    if run.checkpoint.save_interval != "auto":
        return run
    if not run.checkpoint.enabled:
        return dataclasses.replace(
            run, checkpoint=dataclasses.replace(run.checkpoint, save_interval=None)
        )
    plan = time_plan(run)
    if plan is None:
        why = step_time(run, recipe_padded_vocab(run)).detail
        raise ConfigError(
            f"checkpoint.save_interval=auto needs the step time ({why}): give "
            "train.step_time_s=<seconds per step> or a number of steps"
        )
    steps = plan.young_steps
    if time_limit_s is not None:
        steps = max(1, min(steps, _fitting_interval(run, plan, time_limit_s)))
    checkpoint = dataclasses.replace(run.checkpoint, save_interval=steps)
    return dataclasses.replace(run, checkpoint=checkpoint)


def _blocking_save_s(run: RunConfig, plan: TimePlan) -> float:
    return 0.0 if run.checkpoint.async_save else plan.save_s  # training waits for sync saves


def _fitting_interval(run: RunConfig, plan: TimePlan, time_limit_s: float) -> int:
    """The longest interval (steps) of which a job of ``time_limit_s`` fits a start and two."""
    room = time_limit_s - START_ALLOWANCE_S - 2 * _blocking_save_s(run, plan)
    return math.floor(room / (2 * plan.step_s))


def progress_problems(
    run: RunConfig,
    time_limit_s: float | None,
    grace_s: float,
    grace_key: str = "launch.slurm.signal_grace_s",
) -> list[str]:
    """Why a job of ``time_limit_s`` (None: unbounded) with ``grace_s`` between the stop
    signal and the kill would not make progress, each with the smallest fix; empty when it
    would, or when the step time cannot be known (nothing to judge by)."""
    plan = time_plan(run)
    interval = run.checkpoint.save_interval
    if plan is None or not isinstance(interval, int) or not run.checkpoint.enabled:
        return []
    squeeze = _interval_problem(run, plan, interval, time_limit_s)
    problems = [] if squeeze is None else [squeeze]
    needed = START_ALLOWANCE_S + 2 * (interval * plan.step_s + _blocking_save_s(run, plan))
    # A squeezed interval's fix already asks for the time limit two longer intervals need.
    if time_limit_s is not None and time_limit_s < needed and squeeze is None:
        room = _fitting_interval(run, plan, time_limit_s)
        fix = (
            f"set checkpoint.save_interval<={room} (or auto), or a time limit of at least "
            f"{human_duration(needed)}"
            if room >= 1
            else f"no save interval fits: give a time limit of at least {human_duration(needed)}"
        )
        problems.append(
            f"launch.slurm.time_limit ({human_duration(time_limit_s)}) is shorter than a start "
            f"plus two save intervals ({human_duration(needed)}: "
            f"checkpoint.save_interval={interval} x {plan.step_s:.3g} s per step, "
            f"{plan.step_detail}), so a requeued job may end before its first save and start "
            f"again from the same step: {fix}"
        )
    needed_grace = plan.step_s + plan.save_s
    if run.resiliency.preemption and grace_s < needed_grace:
        problems.append(
            f"{grace_key}={grace_s:.0f} cannot cover the step in flight "
            f"({plan.step_s:.3g} s) plus an emergency save ({plan.save_s:.0f} s at "
            f"checkpoint.plan_bandwidth={run.checkpoint.plan_bandwidth:g} GB/s): set "
            f"{grace_key}={math.ceil(needed_grace)} or more"
        )
    return problems


def _interval_problem(
    run: RunConfig, plan: TimePlan, interval: int, time_limit_s: float | None
) -> str | None:
    """Saves too close together, with the smallest fix; None when they are not. A save must
    not take longer than the steps between two (an async save would still be writing when the
    next one starts, a sync save would stop training more than it trains), and a time limit
    that leaves room only for a save every step (what ``auto`` resolves to when nothing longer
    fits) is too short, however cheap the save."""
    # the steps one save takes
    save_steps = math.ceil(plan.save_s / plan.step_s) if plan.save_s >= JUDGED_SAVE_S else 1
    fitting = _fitting_interval(run, plan, time_limit_s) if time_limit_s is not None else None
    squeezed = interval == 1 and plan.young_steps > 1 and fitting is not None and fitting <= 1
    if interval >= save_steps and not squeezed:
        return None
    reasons = []
    if interval < save_steps:
        reasons.append(
            f"one save takes {plan.save_s:.0f} s (at checkpoint.plan_bandwidth="
            f"{run.checkpoint.plan_bandwidth:g} GB/s), longer than the {interval} step(s) "
            f"between two ({interval * plan.step_s:.3g} s), so saves would queue and training "
            "wait on them"
        )
    if squeezed:
        reasons.append(
            f"launch.slurm.time_limit ({human_duration(time_limit_s or 0)}) leaves room for a "
            f"save every step only (Young's interval: {plan.young_steps} steps)"
        )
    wanted = max(save_steps, 2 if squeezed else 1)
    if fitting is not None and fitting < wanted:
        needed = START_ALLOWANCE_S + 2 * (wanted * plan.step_s + _blocking_save_s(run, plan))
        fix = f"give a time limit of at least {human_duration(needed)}"
    else:
        fix = f"set checkpoint.save_interval>={wanted}"
    return f"checkpoint.save_interval={interval}: " + ", and ".join(reasons) + ": " + fix


def human_duration(seconds: float) -> str:
    """Seconds, minutes or hours, as the planners print durations."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"
