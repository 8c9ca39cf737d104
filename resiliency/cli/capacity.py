"""``capacity`` (formerly ``plan``): checkpoint size, storage with retention, and a first
checkpoint interval, in minutes and (given a step time, or a recipe whose step time can be
estimated) in steps.

Size per version counts the persistent training state of mixed-precision training (section 9
of the fault-tolerance notes: bf16 params 2 B + fp32 master 4 B + Adam moments 8 B = 14 B per
parameter; pretrain/fit/timing.py owns the figures, and ``--plan`` uses the same). The interval
is Young's approximation sqrt(2 * C * MTBF) (section 16): a starting point for fault-injection
measurements, not the final answer. ``recipe=<name>`` and Hydra
overrides supply the parameter count, dtype, retention and step time (capacity_recipe.py).
"""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass

from pretrain.fit.timing import (
    DEFAULT_MFU,
    MAIN_PARAM_BYTES,
    MOMENT_BYTES,
    WEIGHT_BYTES,
    StepTime,
    checkpoint_bytes_per_param,
    human_duration,
    job_mtbf_s,
    resolve_save_interval,
    save_seconds,
)
from recipes import ConfigError
from recipes.gpus import lookup_gpu
from resiliency.cli.base import EXIT_OK, EXIT_USAGE, Command
from resiliency.cli.capacity_recipe import RecipeFacts, estimate_step_time, recipe_facts
from resiliency.cli.recorded import schema_default

# Optimizer state per parameter, in fp32: Adam keeps two moments, SGD one momentum buffer.
OPTIMIZER_MOMENTS = {"adam": ("first and second moments", 2), "sgd": ("momentum", 1)}
HEADROOM = (0.20, 0.30)  # temporary writes, retries, fragmentation (section 9)
NOT_COUNTED = (
    "gradients (+2 B/param if saved in bf16, ~16 B/param in total)",
    "RNG states, data-loader indices and scheduler state (kilobytes per rank)",
    "shard metadata, index and alignment padding of the checkpoint format",
    "activations and communication buffers (never checkpointed)",
)
_SUFFIX = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_DURATION_RE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([smhd])")


@dataclass(frozen=True)
class Component:
    name: str
    bytes_per_param: int


@dataclass(frozen=True)
class CheckpointSize:
    params: float
    components: tuple[Component, ...]

    @property
    def bytes_per_param(self) -> int:
        return sum(c.bytes_per_param for c in self.components)

    @property
    def bytes(self) -> float:
        return self.params * self.bytes_per_param


@dataclass(frozen=True)
class Storage:
    version_bytes: float
    keep: int
    headroom: tuple[float, float] = HEADROOM

    @property
    def retained_bytes(self) -> float:
        return self.version_bytes * self.keep

    def with_headroom(self) -> tuple[float, float]:
        low, high = self.headroom
        return self.retained_bytes * (1 + low), self.retained_bytes * (1 + high)


@dataclass(frozen=True)
class Interval:
    save_s: float
    mtbf_s: float

    @property
    def young_s(self) -> float:
        return math.sqrt(2 * self.save_s * self.mtbf_s)

    @property
    def expected_loss_s(self) -> float:
        """Work lost per failure: on average half an interval, plus the save in flight."""
        return self.young_s / 2 + self.save_s

    @property
    def overhead(self) -> float:
        """Fraction of wall time spent saving (synchronous saves)."""
        return self.save_s / (self.young_s + self.save_s)

    def steps(self, step_s: float) -> int:
        """The Young interval in whole training steps (at least one)."""
        return max(1, round(self.young_s / step_s))


def predicted_goodput(
    interval_s: float,
    save_s: float,
    restart_s: float,
    mtbf_s: float,
    *,
    first_start_s: float = 0.0,
    train_s: float | None = None,
    first_save_extra_s: float = 0.0,
    in_flight_s: float = 0.0,
    mtbf_of_training: bool = False,
) -> float:
    """The goodput of saving every ``interval_s`` of training at a blocking cost ``save_s``
    each, with failures every ``mtbf_s`` of wall time (Young/Daly), and every cost a real run
    pays besides: the first start ``first_start_s`` (launch -> first step, once per ``train_s``
    of training), and per failure its recovery ``restart_s`` (fault -> the next first step: the
    recovery ledger's total), the extra blocking of each attempt's first save, and the work
    lost: half an interval on average, plus the save in flight (``in_flight_s``, an async save's
    start -> commit: a fault then loses back to the save before it).

    wall = S0 + T (1 + C/tau) + (wall / M) (R + C1 + tau/2 + W), so goodput = T / wall =
    (1 - (R + C1 + tau/2 + W) / M) / (1 + C/tau + S0/T). 0 where failures come faster than
    recovery. With ``mtbf_of_training``, M counts training time (a fault every M seconds of
    training, as a soak plans them): wall = S0 + T (1 + C/tau) + (T / M) (R + C1 + tau/2 + W),
    so goodput = 1 / (1 + C/tau + S0/T + (R + C1 + tau/2 + W) / M)."""
    per_failure = restart_s + first_save_extra_s + interval_s / 2 + in_flight_s
    start = first_start_s / train_s if train_s else 0.0
    if mtbf_of_training:
        return 1.0 / (1.0 + save_s / interval_s + start + per_failure / mtbf_s)
    return max(0.0, 1.0 - per_failure / mtbf_s) / (1.0 + save_s / interval_s + start)


def parse_count(text: str) -> float:
    """``70e9``, ``7B``, ``405b``, ``1.5T``, ``125M`` or a plain integer."""
    value = text.strip().lower().replace("_", "").replace(",", "")
    scale = _SUFFIX.get(value[-1:], None)
    number = value[:-1] if scale else value
    try:
        count = float(number) * (scale or 1)
    except ValueError:
        raise ValueError(
            f"cannot read {text!r} as a parameter count (e.g. 70e9, 7B, 405B)"
        ) from None
    if not count > 0:
        raise ValueError(f"parameter count must be positive, got {text!r}")
    if scale is None and count < 1e6:  # "70" meant 70B: no model worth planning has 70 params
        raise ValueError(
            f"--params {text}: {count:g} parameters? give the count with its scale, e.g. "
            f"{text}e9 or {text}B"
        )
    return count


def parse_duration(text: str) -> float:
    """Seconds in ``3h``, ``90m``, ``45s``, ``1d``, ``1h30m`` or a plain number of seconds."""
    value = text.strip().lower().replace(" ", "")
    try:
        seconds = float(value)
    except ValueError:
        seconds = _compound_duration(value, text)
    if not seconds > 0:
        raise ValueError(f"duration must be positive, got {text!r}")
    return seconds


def _compound_duration(value: str, original: str) -> float:
    parts = _DURATION_RE.findall(value)
    if not parts or "".join(n + u for n, u in parts) != value:
        raise ValueError(f"cannot read {original!r} as a duration (e.g. 3h, 90m, 45s, 1h30m)")
    return sum(float(n) * _DURATION_UNITS[u] for n, u in parts)


def checkpoint_size(params: float, optimizer: str = "adam", dtype: str = "bf16") -> CheckpointSize:
    """The components of pretrain.fit.timing.checkpoint_bytes_per_param, named."""
    moments, count = OPTIMIZER_MOMENTS[optimizer]
    components = (
        Component(f"{dtype} model parameters", WEIGHT_BYTES[dtype]),
        Component(
            "fp32 main params (the optimizer's; saved for fp32 weights too)", MAIN_PARAM_BYTES
        ),
        Component(f"{optimizer} {moments} (fp32)", MOMENT_BYTES * count),
    )
    size = CheckpointSize(params, components)
    assert size.bytes_per_param == checkpoint_bytes_per_param(dtype, count)
    return size


def human_bytes(n: float) -> str:
    """Decimal units, as storage is sold and as the sizing notes quote it (980 GB for 70B)."""
    for unit, scale in (("PB", 1e15), ("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def human_count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6)):
        if n >= scale:
            return f"{n / scale:g}{unit}"
    return f"{n:g}"


@dataclass(frozen=True)
class PlanContext:
    """Where the plan's inputs came from (recipe, flags, defaults), and the step time."""

    params_from: str = ""
    keep_from: str = ""
    step: StepTime | None = None
    recipe: str | None = None
    save_interval: int | str | None = None  # the recipe's checkpoint.save_interval
    interval_from: str = ""  # where the save time and MTBF came from, when not flags
    auto_detail: str = ""  # what checkpoint.save_interval=auto resolves to, where


def human_step(seconds: float) -> str:
    """Step times are often below a second: three significant digits there."""
    return f"{seconds:.3g} s" if seconds < 120 else human_duration(seconds)


def render_plan(
    size: CheckpointSize, storage: Storage, interval: Interval, ctx: PlanContext | None = None
) -> str:
    ctx = ctx or PlanContext()
    low, high = storage.with_headroom()
    source = f" ({ctx.params_from})" if ctx.params_from else ""
    lines = [
        f"Checkpoint plan for {human_count(size.params)} parameters{source}",
        "",
        "Size of one checkpoint version (full training state):",
    ]
    lines += [f"  {c.bytes_per_param:>2} B/param  {c.name}" for c in size.components]
    lines += [
        f"  {size.bytes_per_param:>2} B/param  total = {human_bytes(size.bytes)} "
        f"({size.bytes / 2**30:.1f} GiB) per version",
        "  Not counted:",
        *(f"    - {item}" for item in NOT_COUNTED),
        "",
        f"Storage, keeping {storage.keep} version(s): {human_bytes(storage.retained_bytes)}",
        *([f"  {ctx.keep_from}"] if ctx.keep_from else []),
        f"  with {storage.headroom[0]:.0%}-{storage.headroom[1]:.0%} headroom "
        f"(temporary writes, retries, fragmentation): "
        f"{human_bytes(low)} - {human_bytes(high)}",
        "",
        f"Checkpoint interval (Young): sqrt(2 x {human_duration(interval.save_s)} save x "
        f"{human_duration(interval.mtbf_s)} MTBF) = {human_duration(interval.young_s)}",
        *([f"  ({ctx.interval_from})"] if ctx.interval_from else []),
        *_step_lines(interval, ctx),
        f"  expected work lost per failure ~ interval/2 + save = "
        f"{human_duration(interval.expected_loss_s)}",
        f"  time spent saving (synchronous): {interval.overhead:.1%}",
        "  A starting point: measure save time and recovery with `python -m drill` "
        "before fixing the interval.",
    ]
    return "\n".join(lines)


def _step_lines(interval: Interval, ctx: PlanContext) -> list[str]:
    """The interval in steps, as ``checkpoint.save_interval`` takes it, when a step time is
    known; otherwise what would make it known."""
    step = ctx.step
    if step is None or step.seconds is None:
        why = step.detail if step else "give --step-time, or recipe=<name> to estimate it"
        return [f"  in steps: {why}"]
    n = interval.steps(step.seconds)
    lines = [
        f"  step time: {human_step(step.seconds)} ({step.detail})",
        f"  in steps: {human_duration(interval.young_s)} / {human_step(step.seconds)} per "
        f"step = {n} steps -> checkpoint.save_interval={n}",
    ]
    if ctx.recipe is not None:
        if ctx.save_interval == "auto":
            configured = f"saves with auto: {ctx.auto_detail}"
        elif ctx.save_interval:
            configured = (
                f"saves every {ctx.save_interval} steps = "
                f"{human_step(ctx.save_interval * step.seconds)}"
            )
        else:
            configured = "saves only at the end of training"
        lines.append(f"  recipe {ctx.recipe} {configured} (its checkpoint.save_interval)")
    return lines


def _add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="OVERRIDE",
        help="recipe=<name> and Hydra overrides of it (key=value): the parameter count, "
        "dtype, retention and step time come from it unless given as flags",
    )
    parser.add_argument("--params", help="parameter count: 70e9, 7B, 405B (default: the recipe's)")
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZER_MOMENTS), default="adam")
    parser.add_argument(
        "--dtype",
        choices=sorted(WEIGHT_BYTES),
        default=None,
        help="parameter dtype in training (default bf16, or the recipe's train.precision)",
    )
    parser.add_argument(
        "--keep",
        type=int,
        default=None,
        help="versions on storage at once (default: checkpoint.keep_last + 1 being written)",
    )
    parser.add_argument(
        "--mtbf",
        help="the job's mean time between failures (default: a recipe's "
        "checkpoint.plan_gpu_mtbf_h over its GPUs, else 3h)",
    )
    parser.add_argument(
        "--save-seconds",
        help="time one checkpoint save blocks training (default: a recipe's checkpoint bytes "
        "at checkpoint.plan_bandwidth, else 30 s)",
    )
    _add_step_args(parser)


def _add_step_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--step-time",
        help="seconds per training step (2.5, 2.5s, 1m): gives the interval in steps",
    )
    parser.add_argument(
        "--gpu", type=str.upper, help="estimate a recipe's step time for this GPU's peak"
    )
    parser.add_argument("--peak-tflops", type=float, help="peak TFLOP/s per GPU, instead of --gpu")
    parser.add_argument(
        "--mfu",
        type=float,
        default=DEFAULT_MFU,
        help=f"model FLOPs utilisation assumed by the estimate (default {DEFAULT_MFU})",
    )
    parser.add_argument(
        "--vocab",
        type=int,
        help="the tokenizer's vocabulary size, when the recipe's tokenizer files are not here",
    )


def _check_numbers(args: argparse.Namespace) -> None:
    if args.keep is not None and args.keep < 1:
        raise ValueError("--keep must be at least 1")
    if not 0 < args.mfu <= 1:
        raise ValueError(f"--mfu must be in (0, 1], got {args.mfu}")
    if args.peak_tflops is not None and not args.peak_tflops > 0:
        raise ValueError(f"--peak-tflops must be positive, got {args.peak_tflops}")
    if args.gpu is not None:
        lookup_gpu(args.gpu)  # the names --plan and launch.gpu take, refused alike
    if args.vocab is not None and args.vocab < 1:
        raise ValueError(f"--vocab must be positive, got {args.vocab}")


def _params(args: argparse.Namespace, facts: RecipeFacts | None) -> tuple[float, str]:
    if args.params:
        return parse_count(args.params), ""
    if facts is None:
        raise ValueError("give --params (e.g. 70e9, 7B), or recipe=<name>")
    if facts.params is None:
        raise ValueError(
            f"recipe {facts.name}: cannot count its parameters, {facts.vocab_detail}; "
            "give --vocab N (the tokenizer's vocabulary size) or --params"
        )
    return facts.params, f"{facts.params:,} in recipe {facts.name}, {facts.vocab_detail}"


def _keep(args: argparse.Namespace, facts: RecipeFacts | None) -> tuple[int, str]:
    """Versions on storage at once: the retained ones plus the one being written."""
    if args.keep is not None:
        return args.keep, ""
    keep_last, where = (
        (facts.keep_last, f"recipe {facts.name}")
        if facts
        else (schema_default("keep_last"), "schema default")
    )
    return keep_last + 1, f"checkpoint.keep_last={keep_last} ({where}) + 1 being written"


def _step_time(args: argparse.Namespace, facts: RecipeFacts | None) -> StepTime | None:
    if args.step_time:
        return StepTime(parse_duration(args.step_time), "--step-time")
    if facts is not None:
        return estimate_step_time(facts, args.gpu, args.peak_tflops, args.mfu)
    return None


def _interval(
    args: argparse.Namespace, facts: RecipeFacts | None, params: float
) -> tuple[Interval, str]:
    """Save time and MTBF: the flags, else the recipe's planning keys (as
    checkpoint.save_interval=auto and the launchers' progress check use them), else 30 s, 3h."""
    sources = []
    if args.save_seconds:
        save_s = parse_duration(args.save_seconds)
    elif facts is not None:
        save_s = save_seconds(facts.run, int(params))
        bandwidth = facts.run.checkpoint.plan_bandwidth
        sources.append(
            f"save: {human_bytes(save_s * bandwidth * 1e9)} at "
            f"checkpoint.plan_bandwidth={bandwidth:g} GB/s"
        )
    else:
        save_s = 30.0
    if args.mtbf:
        mtbf_s = parse_duration(args.mtbf)
    elif facts is not None:
        mtbf_s = job_mtbf_s(facts.run)
        ckpt = facts.run.checkpoint
        sources.append(
            f"MTBF: checkpoint.plan_gpu_mtbf_h={ckpt.plan_gpu_mtbf_h:g} / "
            f"{facts.run.launch.world_size} GPUs"
        )
    else:
        mtbf_s = 3 * 3600.0
    return Interval(save_s, mtbf_s), "; ".join(sources)


def _auto_detail(facts: RecipeFacts) -> str:
    """checkpoint.save_interval=auto as the trainer and the Slurm launcher resolve it."""
    if facts.save_interval != "auto":
        return ""
    try:
        anywhere = resolve_save_interval(facts.run).checkpoint.save_interval
        slurm = facts.run.launch.slurm
        on_slurm = resolve_save_interval(facts.run, slurm.time_limit_s).checkpoint.save_interval
    except ConfigError as exc:
        return str(exc)
    return (
        f"every {anywhere} steps, {on_slurm} on Slurm (two intervals within "
        f"launch.slurm.time_limit={slurm.time_limit})"
    )


def _run(args: argparse.Namespace) -> int:
    try:
        _check_numbers(args)
        facts = recipe_facts(args.overrides, args.vocab) if args.overrides else None
        params, params_from = _params(args, facts)
        keep, keep_from = _keep(args, facts)
        interval, interval_from = _interval(args, facts, params)
        step = _step_time(args, facts)
    except (ValueError, ConfigError) as exc:
        print(f"error: {exc}")
        return EXIT_USAGE
    dtype = args.dtype or (facts.dtype if facts else "bf16")
    size = checkpoint_size(params, args.optimizer, dtype)
    ctx = PlanContext(
        params_from,
        keep_from,
        step,
        facts.name if facts else None,
        facts.save_interval if facts else None,
        interval_from,
        _auto_detail(facts) if facts else "",
    )
    print(render_plan(size, Storage(size.bytes, keep), interval, ctx))
    return EXIT_OK


CAPACITY = Command(
    "checkpoint size, storage with retention, Young interval in minutes and steps",
    _add_args,
    _run,
    overrides=True,
    epilog="e.g. capacity --params 70e9 --mtbf 3h --save-seconds 30 --step-time 6s\n"
    "     capacity recipe=llama3_70b --gpu H100\n"
    "(`plan` is the old name of this command and still works)",
)
COMMANDS = {"capacity": CAPACITY, "plan": CAPACITY}
